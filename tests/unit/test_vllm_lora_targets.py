"""The modules mint asks vLLM to wrap for LoRA (`--lora-target-modules`): what a mint adapter can target on the
base, read from its safetensors headers, never `lm_head` (whose LoRA wrapper costs every step a logits pass and
kills vLLM 0.32's engine when two sequences ask prompt logprobs in one batch)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import SecretStr
from safetensors.torch import save_file

from mint_core.engine import base as engine_base
from mint_core.engine.base import FAMILIES, Family, load_base, tiny_config
from mint_core.serving.vllm_process import FROZEN_MODULES, VLLMConfig, lora_targets


def _targets_flag(cmd: list[str]) -> list[str] | None:
    if "--lora-target-modules" not in cmd:
        return None
    rest = cmd[cmd.index("--lora-target-modules") + 1 :]
    return rest[: next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]


def _config(model: Path, **kw: object) -> VLLMConfig:
    return VLLMConfig(model=model, served_model_name="base", api_key=SecretStr("k"), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_targets_are_the_sites_of_a_real_base_never_lm_head(family: Family, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(tiny_config(family)).save_pretrained(tmp_path / "base")
    sites = load_base(tmp_path / "base").sites.values()
    assert lora_targets(tmp_path / "base") == sorted({"experts" if s.experts else s.short for s in sites})
    assert "lm_head" not in lora_targets(tmp_path / "base")


def test_experts_norms_embeddings_and_frozen_modules(tmp_path: Path) -> None:
    (tmp_path / "moe").mkdir()

    def w() -> torch.Tensor:
        return torch.zeros(2, 2)

    tensors = {
        "model.embed_tokens.weight": w(),
        "lm_head.weight": w(),
        "model.norm.weight": torch.zeros(2),
        "model.layers.0.input_layernorm.weight": torch.zeros(2),
        "model.layers.0.self_attn.q_proj.weight": w(),
        "model.layers.0.self_attn.indexer.wk.weight": w(),
        "model.layers.0.mlp.gate.weight": w(),
        "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 2, 2),
        "model.layers.0.mlp.shared_expert.down_proj.weight": w(),
    }
    # two shards, as a large base is saved
    save_file(dict(list(tensors.items())[:5]), str(tmp_path / "moe" / "model-00001-of-00002.safetensors"))
    save_file(dict(list(tensors.items())[5:]), str(tmp_path / "moe" / "model-00002-of-00002.safetensors"))
    assert lora_targets(tmp_path / "moe") == [
        "down_proj",
        "experts",
        "q_proj",
    ]  # the router beside the experts is no site


def test_the_command_asks_vllm_for_the_targets(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    save_file(
        {"model.layers.0.self_attn.o_proj.weight": torch.zeros(2, 2)}, str(tmp_path / "b" / "m.safetensors")
    )
    assert _targets_flag(_config(tmp_path / "b").command()[0]) == ["o_proj"]
    explicit = _config(tmp_path / "b", lora_target_modules=["q_proj", "v_proj"]).command()[0]
    assert _targets_flag(explicit) == ["q_proj", "v_proj"]
    # weights mint cannot read: refused, naming the field (left to vLLM, lm_head would be wrapped, and two
    # sequences asking prompt logprobs in one batch would kill its engine; the front no longer sends them alone)
    with pytest.raises(ValueError, match=r"has no safetensors weights .* lora_target_modules"):
        _config(tmp_path / "none").command()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="no LoRA target modules"):
        _config(tmp_path / "bad").command()
    # naming them is enough
    assert _targets_flag(_config(tmp_path / "none", lora_target_modules=["q_proj"]).command()[0]) == [
        "q_proj"
    ]


def test_the_frozen_modules_are_the_engines() -> None:
    assert FROZEN_MODULES == engine_base.FROZEN_MODULES
