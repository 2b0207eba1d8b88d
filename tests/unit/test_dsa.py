"""DeepSeek sparse attention (DSA, DeepSeek-V3.2) as a base: a local Hugging Face directory loads through mint's
loader with LoRA sites on MLA's projections and experts (the lightning indexer frozen); a training step moves
only the adapter; mixed-adapter generation through mint's ragged KV cache, with the indexer keeping 4 keys per
query, gives the tokens of a full forward at every step; the indexer's top-k ties, which make a model's own
decode differ from its full forward, are reproduced by mint's cache exactly as transformers' cache has them.

The engine's logits against PEFT's (1e-4 relative, float32), continuous batching and the packed MoE round trip
run for DSA with every family (tests/conftest.py FAMILIES, test_adapter_format.py EXPERT_FAMILIES)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, DynamicCache

from mint_core.data.generators import split
from mint_core.engine.base import Base, build_tiny_base, load_base, tiny_config
from mint_core.engine.engine import Engine, EngineConfig, Request
from mint_core.engine.sampling import SamplingParams
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_core.rl.grpo import GRPOConfig
from mint_core.rl.policy import PolicySpec
from mint_core.rl.rollout import RolloutRow
from mint_core.rl.trainer import MultiPolicyTrainer
from tests.conftest import DEVICES, TARGETS, peft_loadable_sites

MLA_PROJECTIONS = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}


@pytest.fixture(scope="module")
def dsa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DSA base written as any Hugging Face model directory is (weights, config, tokenizer)."""
    where = tmp_path_factory.mktemp("tiny-dsa")
    tiny = build_tiny_base("dsa", seed=0, tokenizer=byte_tokenizer())
    tiny.model.save_pretrained(where)
    assert tiny.tokenizer is not None
    tiny.tokenizer.save_pretrained(where)
    return where


def is_bank(key: str) -> bool:
    """A LoRA slot tensor of a linear (`.bank.`) or of the experts (`.banks.`), not a base weight."""
    return ".bank." in key or ".banks." in key


def load(dsa_dir: Path, device: str = "cpu") -> Base:
    return load_base(dsa_dir, device=device)


def test_a_dsa_directory_loads_with_lora_on_mla_projections_and_experts_not_the_indexer(dsa_dir):
    base = load(dsa_dir)
    assert base.model.config.model_type == "deepseek_v32"
    built = build_tiny_base("dsa", seed=0).model.state_dict()
    loaded = base.model.state_dict()
    assert loaded.keys() == built.keys()
    assert all(torch.equal(loaded[k], built[k]) for k in built)  # the same weights came back
    short = {s.short for s in base.sites.values()}
    assert short >= MLA_PROJECTIONS
    assert {"gate_up_proj", "down_proj"} <= short  # routed experts, packed
    assert not [n for n in base.sites if ".indexer." in n]
    indexers = [n for n, m in base.model.named_modules() if n.endswith("self_attn.indexer")]
    assert len(indexers) == base.config.num_hidden_layers
    # sparse within the tests' sequences: each query keeps 4 keys
    assert base.config.index_topk == 4


def test_the_indexer_gets_no_gradient_so_a_lora_there_would_never_train():
    """Why the indexer has no LoRA site: transformers runs it under no_grad and hands on a discrete top-k."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("dsa"), dtype=torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    attn = model.model.layers[0].self_attn
    watched = [attn.indexer.wq_b.weight, attn.indexer.wk.weight, attn.q_b_proj.weight]
    for p in watched:
        p.requires_grad_(True)
    model(input_ids=torch.randint(0, 256, (2, 12))).logits.square().mean().backward()
    assert attn.indexer.wq_b.weight.grad is None and attn.indexer.wk.weight.grad is None
    assert attn.q_b_proj.weight.grad is not None and attn.q_b_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_training_step_changes_the_adapter_and_never_the_base(dsa_dir, device):
    engine = Engine(load(dsa_dir, device), EngineConfig(max_loras=2, max_lora_rank=8))
    assert engine.base.device.type == device
    specs = [PolicySpec(name="p", task="add", rank=8, alpha=16, targets=TARGETS["dsa"])]
    trainer = MultiPolicyTrainer(engine, GRPOConfig(group_size=4, learning_rate=1e-2), specs, seed=0)
    base_before = {k: v.clone() for k, v in engine.base.model.state_dict().items() if not is_bank(k)}
    before = {s: (A.clone(), B.clone()) for s, (A, B) in trainer.weights("p").tensors.items()}
    example = split("add", 1, 1, 0)[0][0]
    prompt = engine._encode(example.prompt)
    rows = [
        RolloutRow("p", 0, example, prompt, [50 + g, 60, 70 + g], [0.0] * 3, "", r, "length")
        for g, r in enumerate([1.0, 0.0, 0.0, 1.0])
    ]
    stats = trainer.update(rows)
    assert stats.loss.get("p") is not None
    after = trainer.weights("p").tensors
    moved = {s.rpartition(".")[2] for s in after if not torch.equal(after[s][1], before[s][1])}
    assert moved >= MLA_PROJECTIONS, f"LoRA B of the MLA projections did not all move: {moved}"
    for k, v in engine.base.model.state_dict().items():
        if not is_bank(k):
            assert torch.equal(v, base_before[k]), f"base weight {k} changed"


def test_mixed_adapter_generation_equals_full_forward_decoding(dsa_dir, adapter_dir):
    """Each request, decoded greedily in one batch with other adapters (left-padded rows that join the ragged
    cache, the indexer keeping 4 of up to 20 keys), gets the tokens that re-running PEFT's model over the whole
    sequence at every step picks."""
    engine = Engine(load(dsa_dir), EngineConfig(max_loras=3, max_lora_rank=8))
    sites = peft_loadable_sites("dsa", engine.sites)
    for i, name in enumerate(["a", "b"]):
        a = random_adapter(
            sites, TARGETS["dsa"], 4 + 4 * i, seed=i, std=0.3, base_fingerprint=engine.base.fingerprint
        )
        save_adapter(a, adapter_dir / name, engine.sites)
        engine.load_adapter(name, adapter_dir / name)
    requests = [
        Request("The quick brown fox", "a", SamplingParams(max_tokens=8)),
        Request("Hi", "b", SamplingParams(max_tokens=10)),
        Request("abc def ghi", None, SamplingParams(max_tokens=6)),
        Request("sparse", "a", SamplingParams(max_tokens=9)),
    ]
    got = engine.generate(requests)
    texts = {}
    for req, out in zip(requests, got, strict=True):
        reference = load(dsa_dir).model
        if req.adapter is not None:
            reference = PeftModel.from_pretrained(reference, adapter_dir / req.adapter)
        ids = list(out.prompt_token_ids)
        want = []
        with torch.no_grad():
            for _ in range(req.params.max_tokens):
                nxt = int(reference(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
                want.append(nxt)
                ids.append(nxt)
                if nxt == engine.eos_id:
                    break
        assert out.token_ids == want, f"request {req.prompt!r} ({req.adapter})"
        texts[req.adapter] = out.token_ids
    assert texts["a"] != texts["b"]  # the adapters do steer the output


def test_topk_ties_decode_as_in_transformers_own_cache():
    """With two indexer heads many ReLU'd scores are exactly 0; torch.topk then picks among equal scores by
    position in a tensor whose length differs between a decode step and a full forward, so the model's own
    cached decode is not its full forward. mint's ragged cache decodes a sequence exactly as transformers'
    DynamicCache does, ties included (the tiny DSA config uses eight heads so the tests see no ties)."""
    base = build_tiny_base("dsa", seed=0, tokenizer=byte_tokenizer(), index_n_heads=2)
    model = base.model
    prompt = list(b"ties at zero, again and again")
    steps = 12

    with torch.no_grad():
        ids, cache = torch.tensor([prompt]), DynamicCache(config=model.config)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        hf = []
        for _ in range(steps):
            nxt = int(out.logits[0, -1].argmax())
            hf.append(nxt)
            out = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
        full = (
            model(input_ids=torch.tensor([prompt + hf])).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
        )
    assert full != hf, "no tie changed a token: the case this test documents did not arise"

    engine = Engine(base, EngineConfig(max_loras=1, max_lora_rank=4))
    mint = engine.generate([Request(prompt, None, SamplingParams(max_tokens=steps, ignore_eos=True))])[0]
    assert mint.token_ids == hf
