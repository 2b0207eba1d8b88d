"""A base is any Hugging Face causal-LM directory with its own tokenizer and chat template: the tiny Llama, Qwen2
and Qwen3 chat bases built here (a BPE tokenizer trained locally, the family's template), one prompt rendering
everywhere, generation that stops at EOS and at the end of turn, and check_base's errors before anything starts."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from mint_app.cli.app import app
from mint_app.services import control as services
from mint_app.services.config import ServiceError, ServicesConfig
from mint_app.services.control import start
from mint_core.engine.base import build_tiny_chat_base, load_base
from mint_core.engine.chat import prompt_ids, render_prompt
from mint_core.engine.chat_tokenizer import CHAT_FAMILIES, CHAT_TOKENS, ChatFamily
from mint_core.engine.engine import Engine, EngineConfig, Request
from mint_core.engine.sampling import SamplingParams
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.errors import BaseError
from mint_core.serving.base_check import VLLM_CPU_HEAD_SIZES, check_base
from mint_core.serving.chat import chat_prompt
from mint_core.serving.protocol import ChatCompletionMessageParam
from mint_core.serving.vllm_process import vllm_available

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Question: Tom has 3 apples and gets 4 more. How many?"}],
    [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "12 + 7 ="},
        {"role": "assistant", "content": "19"},
        {"role": "user", "content": "and 19 * 2?"},
    ],
]


@pytest.fixture(scope="module")
def chat_bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-bases")
    return {f: build_tiny_chat_base(root / f, f) for f in CHAT_FAMILIES}


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("family", CHAT_FAMILIES)
def test_each_family_is_a_normal_hf_directory(chat_bases: dict[str, Path], family: ChatFamily) -> None:
    d = chat_bases[family]
    assert {p.name for p in d.iterdir()} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    spec = CHAT_TOKENS[family]
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True)
    assert model.config.model_type == family
    assert 900 <= len(tok) <= 2048 and model.config.vocab_size == len(tok)
    assert model.config.hidden_size // model.config.num_attention_heads in VLLM_CPU_HEAD_SIZES
    assert json.loads((d / "tokenizer_config.json").read_text())["chat_template"] == spec.template
    # a real BPE: common words are one token, the family's specials are single ids
    assert len(tok(" apples")["input_ids"]) == 1
    ids = {s: tok.convert_tokens_to_ids(s) for s in spec.specials}
    assert all(tok.decode([i]) == s for s, i in ids.items())
    eos = json.loads((d / "generation_config.json").read_text())["eos_token_id"]
    assert tok.eos_token == spec.eos and ids[spec.end_of_turn] in eos and tok.eos_token_id in eos

    base = load_base(d)
    assert base.tokenizer is not None and len(base.tokenizer) == len(tok)
    assert {"q_proj", "o_proj", "down_proj"} <= {s.short for s in base.sites.values()}
    logits = model(**tok("12 + 7 =", return_tensors="pt")).logits
    assert torch.isfinite(logits).all()


def test_the_same_seed_writes_the_same_files(tmp_path: Path, chat_bases: dict[str, Path]) -> None:
    again = build_tiny_chat_base(tmp_path / "again", "qwen2", seed=0)
    assert _digest(again) == _digest(chat_bases["qwen2"])
    other = build_tiny_chat_base(tmp_path / "other", "qwen2", seed=1)
    changed = {k for k, v in _digest(other).items() if _digest(again)[k] != v}
    assert changed == {"model.safetensors"}  # the tokenizer is the family's, the weights the seed's


@pytest.mark.parametrize("family", CHAT_FAMILIES)
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_a_chat_prompt_renders_as_apply_chat_template(
    chat_bases: dict[str, Path], family: str, conversation: int
) -> None:
    tok = AutoTokenizer.from_pretrained(chat_bases[family], local_files_only=True)
    msgs = CONVERSATIONS[conversation]
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert render_prompt(tok, msgs) == want
    served = [ChatCompletionMessageParam(role=m["role"], content=m["content"]) for m in msgs]
    assert chat_prompt(tok, served) == want
    assert want.endswith(
        {
            "llama": "<|start_header_id|>assistant<|end_header_id|>\n\n",
            "qwen2": "<|im_start|>assistant\n",
            "qwen3": "<|im_start|>assistant\n",
        }[family]
    )
    # plain text passes through unchanged
    assert render_prompt(tok, "Question: 2 + 2?\nAnswer:") == "Question: 2 + 2?\nAnswer:"


def test_a_tokenizer_without_a_template_renders_role_lines() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"text": "hi"}]}]
    assert render_prompt(byte_tokenizer(), msgs) == "system: Be brief.\nuser: hi\nassistant:"


@pytest.mark.parametrize("family", CHAT_FAMILIES)
def test_the_engine_stops_at_eos_and_at_the_end_of_turn(chat_bases: dict[str, Path], family: str) -> None:
    spec = CHAT_TOKENS[family]
    base = load_base(chat_bases[family])
    engine = Engine(base, EngineConfig(max_loras=1, max_lora_rank=8))
    tok = engine.tokenizer
    eos, end_of_turn = tok.convert_tokens_to_ids(spec.eos), tok.convert_tokens_to_ids(spec.end_of_turn)
    assert {eos, end_of_turn} <= engine.eos_ids

    # a real change of the model's head: from the third generated token on, `forced` wins by a wide margin
    forced = {"token": end_of_turn}
    calls = {"n": 0}

    def bias(_m: Any, _args: Any, out: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] >= 3:
            out = out.clone()
            out[..., forced["token"]] += 1e4
        return out

    hook = base.model.get_output_embeddings().register_forward_hook(bias)
    prompt = render_prompt(tok, CONVERSATIONS[0])
    try:
        for token in {end_of_turn, eos}:
            forced["token"], calls["n"] = token, 0
            out = engine.generate([Request(prompt, None, SamplingParams(max_tokens=8))])[0]
            assert (out.finish_reason, len(out.token_ids), out.token_ids[-1]) == ("stop", 3, token)
            assert spec.end_of_turn not in out.text and spec.eos not in out.text
        calls["n"] = 0
        going = engine.generate([Request(prompt, None, SamplingParams(max_tokens=8, ignore_eos=True))])[0]
        assert (going.finish_reason, len(going.token_ids)) == ("length", 8)
    finally:
        hook.remove()


def test_build_tiny_chat_from_the_cli(tmp_path: Path, chat_bases: dict[str, Path]) -> None:
    got = CliRunner().invoke(app, ["base", "build-tiny", str(tmp_path / "q"), "--family", "qwen2", "--chat"])
    assert got.exit_code == 0, got.output
    assert _digest(tmp_path / "q") == _digest(chat_bases["qwen2"])
    bad = CliRunner().invoke(app, ["base", "build-tiny", str(tmp_path / "m"), "--family", "moe", "--chat"])
    assert bad.exit_code != 0 and "llama, qwen2, qwen3" in bad.output


# ---- check_base: every problem, before anything starts ----------------------------------------------------------


def _edit_json(name: str, **change: Any) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        doc = json.loads((d / name).read_text())
        for k, v in change.items():
            if v is None:
                doc.pop(k, None)
            else:
                doc[k] = v
        (d / name).write_text(json.dumps(doc))

    return edit


def _remove(*names: str) -> Callable[[Path], None]:
    def remove(d: Path) -> None:
        for n in names:
            (d / n).unlink()

    return remove


def _template(text: str) -> Callable[[Path], None]:
    return _edit_json("tokenizer_config.json", chat_template=text)


def _no_eos(d: Path) -> None:
    _edit_json("tokenizer_config.json", eos_token=None)(d)
    _remove("generation_config.json")(d)
    _edit_json("config.json", eos_token_id=None)(d)


SYSTEM_FIRST = (
    "{% if messages[0]['role'] != 'system' %}{{ raise_exception('the first message must be a system one') }}"
    "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
)

# (case, the good chat base it changes, the change, check_base's keyword arguments, what the error says)
BAD_BASES = [
    (
        "no tokenizer",
        "qwen2",
        _remove("tokenizer.json", "tokenizer_config.json"),
        {},
        r"no tokenizer \(tokenizer.json",
    ),
    (
        "template refuses the task's messages",
        "qwen2",
        _template(SYSTEM_FIRST),
        {"sample_messages": CONVERSATIONS[0]},
        r"chat template fails on sample 0: .*the first message must be a system one",
    ),
    (
        "template is not valid Jinja",
        "qwen2",
        _template("{% for m in messages %}{{ m['content'] }"),
        {},
        r"chat template fails on sample 0: TemplateSyntaxError",
    ),
    (
        "a message without a role",
        "qwen2",
        lambda d: None,
        {"sample_messages": [[{"content": "hi"}]]},
        r"chat template fails on sample 0: .*message 0 has no role",
    ),
    (
        "no config.json",
        "qwen2",
        _remove("config.json"),
        {},
        r"no config.json: not a Hugging Face model directory",
    ),
    (
        "not a causal LM",
        "qwen2",
        _edit_json("config.json", model_type="not_a_model"),
        {},
        r"model_type 'not_a_model' is not a causal LM",
    ),
    ("no weights", "qwen2", _remove("model.safetensors"), {}, r"no weights \(model.safetensors"),
    (
        "vocab smaller than the tokenizer",
        "qwen2",
        _edit_json("config.json", vocab_size=100),
        {},
        r"more than config.json's vocab_size 100",
    ),
    ("no EOS", "llama", _no_eos, {}, r"no EOS token"),
    (
        "vLLM's CPU attention lacks the head size",
        "qwen2",
        _edit_json("config.json", num_attention_heads=8, num_key_value_heads=2),
        {"serving": "vllm", "vllm_python": Path("/nonexistent/python")},
        r"config.json: head_dim 16 \(hidden_size / num_attention_heads\) is not a head size vLLM's CPU attention supports \(32, 64",
    ),
    (
        "context shorter than vLLM's max_model_len",
        "qwen2",
        _edit_json("config.json", max_position_embeddings=256),
        {"serving": "vllm", "vllm_python": Path("/nonexistent/python"), "max_model_len": 512},
        r"max_position_embeddings 256 is below vLLM's max_model_len 512",
    ),
    pytest.param(
        "an architecture vLLM does not serve",
        "qwen2",
        _edit_json("config.json", architectures=["Qwen2MadeUpForCausalLM"]),
        {"serving": "vllm"},
        r"config.json: architectures \['Qwen2MadeUpForCausalLM'\] is none that vLLM 0\.\d+",
        # asks vLLM's own environment (about 10 s)
        marks=[
            pytest.mark.integration,
            pytest.mark.skipif(not vllm_available(), reason="vLLM's environment (make vllm-venv)"),
        ],
    ),
]


@pytest.mark.parametrize(
    ("case", "family", "change", "kwargs", "message"),
    BAD_BASES,
    ids=[c.values[0] if hasattr(c, "values") else c[0] for c in BAD_BASES],
)
def test_a_bad_base_is_refused_naming_the_directory_and_the_problem(
    tmp_path: Path,
    chat_bases: dict[str, Path],
    case: str,
    family: str,
    change: Callable[[Path], None],
    kwargs: dict[str, Any],
    message: str,
) -> None:
    d = tmp_path / "base"
    shutil.copytree(chat_bases[family], d)
    change(d)
    before = _digest(d)
    with pytest.raises(BaseError, match=message) as e:
        check_base(d, **kwargs)
    assert str(e.value).startswith(f"base {d} cannot be used")
    assert _digest(d) == before  # checked, nothing written


@pytest.mark.parametrize("family", CHAT_FAMILIES)
def test_a_good_base_passes_with_the_tasks_messages(chat_bases: dict[str, Path], family: str) -> None:
    tok = AutoTokenizer.from_pretrained(chat_bases[family], local_files_only=True)
    report = check_base(
        chat_bases[family],
        [*CONVERSATIONS, "plain text"],
        serving="vllm",
        vllm_python=Path("/nonexistent/python"),
        max_model_len=512,
    )
    assert report.chat_template and report.model_type == family
    assert report.rendered == [render_prompt(tok, c) for c in [*CONVERSATIONS, "plain text"]]
    spec = CHAT_TOKENS[family]
    assert report.stop_token_ids == {
        tok.convert_tokens_to_ids(t) for t in (spec.eos, spec.end_of_turn, spec.pad)
    }


def test_mint_up_refuses_a_base_without_a_tokenizer_before_starting_anything(
    tmp_path: Path, chat_bases: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in list(os.environ):  # the shell's serving settings must not count
        if key.startswith(("MINT_SERVE_", "MINT_SERVICES_")):
            monkeypatch.delenv(key)
    d = tmp_path / "base"
    shutil.copytree(chat_bases["llama"], d)
    _remove("tokenizer.json", "tokenizer_config.json")(d)
    cfg = ServicesConfig(state_dir=tmp_path / "state", serve_base=str(d), serve_port=18131)

    def launched(name: str, config: ServicesConfig) -> None:
        raise AssertionError(f"{name} was launched")

    monkeypatch.setattr(services, "_launch", launched)
    with pytest.raises(ServiceError, match=rf"serve: base {d} cannot be used .*\n  - no tokenizer"):
        start(cfg, ["serve"])
    assert not list(cfg.state_dir.glob("*.pid"))


def test_a_chat_prompt_gets_one_bos_where_the_tokenizer_adds_one_too(chat_bases: dict[str, Path]) -> None:
    """Llama 3's real tokenizer adds <|begin_of_text|> to every encoding and its template writes one as well:
    a conversation is tokenized as vLLM's chat route does (nothing added), plain text as /v1/completions does."""
    from tokenizers import processors

    tok = AutoTokenizer.from_pretrained(chat_bases["llama"], local_files_only=True)
    bos = tok.bos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    msgs = CONVERSATIONS[0]
    assert tok(render_prompt(tok, msgs))["input_ids"][:2] == [bos, bos]  # what encoding the text would give
    ids = prompt_ids(tok, msgs)
    assert ids[0] == bos and ids.count(bos) == 1
    assert prompt_ids(tok, "12 + 7 =")[:1] == [bos]


def test_base_check_from_the_cli_renders_a_task_files_prompts(
    tmp_path: Path, chat_bases: dict[str, Path]
) -> None:
    rows = tmp_path / "train.jsonl"
    rows.write_text(
        "\n".join(json.dumps({"prompt": p, "answer": "7"}) for p in [CONVERSATIONS[0], "3 + 4 ="]) + "\n"
    )
    ok = CliRunner().invoke(app, ["base", "check", str(chat_bases["qwen3"]), "--prompts", str(rows)])
    assert ok.exit_code == 0, ok.output
    assert "its own chat template" in ok.output and "2 prompt(s) rendered" in ok.output
    d = tmp_path / "base"
    shutil.copytree(chat_bases["qwen3"], d)
    _template(SYSTEM_FIRST)(d)
    bad = CliRunner().invoke(app, ["base", "check", str(d), "--prompts", str(rows)])
    assert bad.exit_code == 1
    assert f"base {d} cannot be used" in bad.output and "the first message must be a system one" in bad.output


@pytest.mark.parametrize("family", CHAT_FAMILIES)
def test_an_adapter_on_a_chat_base_gives_the_logits_peft_gives(
    chat_bases: dict[str, Path], family: str, tmp_path: Path
) -> None:
    """Qwen2's biased q/k/v, Qwen3's q/k norms, the Qwen families' tied embeddings: mint's engine with a LoRA
    revision on every linear of the layers equals PEFT's PeftModel on the same directory (float32, 1e-4)."""
    from peft import PeftModel

    from mint_core.lora.adapter import random_adapter, save_adapter

    engine = Engine(load_base(chat_bases[family]), EngineConfig(max_loras=1, max_lora_rank=8))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    a = random_adapter(engine.sites, targets, 8, seed=0, std=0.3, base_fingerprint=engine.base.fingerprint)
    save_adapter(a, tmp_path / "a", engine.sites)
    engine.load_adapter("a", tmp_path / "a")
    ids = torch.tensor([prompt_ids(engine.tokenizer, CONVERSATIONS[1])])
    got = engine.logits(ids, ["a"])
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(chat_bases[family], local_files_only=True), tmp_path / "a"
    )
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        bare = AutoModelForCausalLM.from_pretrained(chat_bases[family], local_files_only=True)(
            input_ids=ids
        ).logits
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    assert (want - bare).abs().max() > 1e-3  # the adapter did change the answer


def test_mint_serve_refuses_a_base_without_a_tokenizer_naming_it(
    tmp_path: Path, chat_bases: dict[str, Path]
) -> None:
    from mint_core.serving.app import load_serving_base
    from mint_core.serving.config import ServingConfig

    d = tmp_path / "base"
    shutil.copytree(chat_bases["qwen3"], d)
    _remove("tokenizer.json", "tokenizer_config.json")(d)
    with pytest.raises(BaseError, match=rf"^base {d} cannot be used .*\n  - no tokenizer"):
        load_serving_base(ServingConfig(base=str(d)))
