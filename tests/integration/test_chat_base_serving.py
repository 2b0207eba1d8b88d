"""A tiny Qwen2 chat base (a BPE tokenizer trained here, ChatML template, generation_config listing <|endoftext|>
and <|im_end|>) served by both backends: mint serve answers /v1/chat/completions through the official `openai`
client with the prompt render_prompt gives, and a real vLLM renders the same prompt tokens and stops at the end of
turn (which only generation_config names: the tokenizer's EOS is <|endoftext|>)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from mint_app.services.config import ServicesConfig
from mint_app.services.control import start, stop
from mint_app.services.stack import find_stack
from mint_core.engine.base import build_tiny_chat_base, load_base
from mint_core.engine.chat import render_prompt
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_core.serving.base_check import check_base
from mint_core.serving.vllm_process import vllm_available
from mint_testkit.harness import VLLM_KEY, VLLM_PYTHON, free_port, start_server, start_vllm, stop_server
from mint_testkit.skips import require

pytestmark = pytest.mark.integration

MESSAGES = [
    {"role": "system", "content": "Answer with a number."},
    {
        "role": "user",
        "content": "Question: Tom has 12 apples and gets 7 more. How many apples does Tom have now?",
    },
]


@pytest.fixture(scope="module")
def chat_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_base(tmp_path_factory.mktemp("chat") / "tiny-qwen2-chat", "qwen2")


@pytest.fixture(scope="module")
def mint_url(chat_base: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    store = tmp_path_factory.mktemp("store")
    proc, url = start_server(store, "--base", str(chat_base))
    try:
        yield url
    finally:
        stop_server(proc)


def test_mint_serve_answers_chat_with_the_rendered_prompt(chat_base: Path, mint_url: str) -> None:
    tok = AutoTokenizer.from_pretrained(chat_base, local_files_only=True)
    rendered = render_prompt(tok, MESSAGES)
    oai = OpenAI(base_url=mint_url + "/v1", api_key="unused")
    chat = oai.chat.completions.create(
        model=chat_base.name,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == len(tok(rendered)["input_ids"])
    assert chat.choices[0].finish_reason in ("stop", "length")
    # a chat is its rendered prompt completed: the same greedy answer through /v1/completions
    plain = oai.completions.create(model=chat_base.name, prompt=rendered, max_tokens=12, temperature=0)
    assert plain.choices[0].text == chat.choices[0].message.content
    assert plain.usage is not None and plain.usage.prompt_tokens == chat.usage.prompt_tokens


@pytest.mark.slow  # a vLLM of its own (the default tier keeps one vLLM, the session's)
def test_vllm_serves_the_chat_base_with_the_same_prompt_and_stops_at_the_end_of_turn(
    chat_base: Path, tmp_path: Path
) -> None:
    require(vllm_available(VLLM_PYTHON), f"vLLM's environment {VLLM_PYTHON} (make vllm-venv)")
    check_base(chat_base, MESSAGES, serving="vllm", vllm_python=VLLM_PYTHON, max_model_len=512)
    tok = AutoTokenizer.from_pretrained(chat_base, local_files_only=True)
    im_end, endoftext = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token_id == endoftext != im_end
    port = free_port()
    proc = start_vllm(chat_base, port, None, tmp_path / "vllm.log")
    try:
        headers = {"Authorization": f"Bearer {VLLM_KEY}"}
        body = {"model": chat_base.name, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={**body, "return_token_ids": True},
            headers=headers,
            timeout=120,
        )
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["prompt_token_ids"] == tok(render_prompt(tok, MESSAGES))["input_ids"]
        # the end of turn made the likeliest token: vLLM stops there (from generation_config's eos_token_id)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={**body, "return_token_ids": True, "logit_bias": {str(im_end): 100}},
            headers=headers,
            timeout=120,
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice["finish_reason"], choice["token_ids"], choice["message"]["content"]) == (
            "stop",
            [im_end],
            "",
        )
        # a LoRA revision of the chat base (every linear of its layers) loads and answers
        base = load_base(chat_base)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        a = random_adapter(base.sites, targets, 8, seed=1, std=0.3, base_fingerprint=base.fingerprint)
        save_adapter(a, tmp_path / "rev", base.sites)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/load_lora_adapter",
            json={"lora_name": "rev", "lora_path": str(tmp_path / "rev")},
            headers=headers,
            timeout=120,
        )
        assert r.status_code == 200, r.text
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={**body, "model": "rev"},
            headers=headers,
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        stop_server(proc, timeout=60)


def test_mint_up_with_a_base_serves_it_and_the_stacks_flows_train_on_it(
    chat_base: Path, tmp_path: Path
) -> None:
    """`mint up --base DIR` (serve only here): mint serve loads DIR, and a later command of the same state dir
    that names no base (a `mint lifecycle`, the dashboard's runs) gets DIR as its workspace's base."""
    config = ServicesConfig(state_dir=tmp_path / "run", serve_port=free_port(), serve_base=str(chat_base))
    try:
        (served,) = start(config, ["serve"])
        assert served.state == "running"
        admin = {"Authorization": "Bearer " + (config.state_dir / "serve.token").read_text().strip()}
        models = httpx.get(served.api_url + "/v1/models", headers=admin, timeout=30).json()["data"]
        assert chat_base.name in {m["id"] for m in models}
        later = ServicesConfig(state_dir=tmp_path / "run", serve_port=config.serve_port)
        assert find_stack(later).workspace["base"] == str(chat_base.resolve())
    finally:
        stop(config, ["serve"])


@pytest.mark.slow  # a vLLM of its own (the default tier keeps one vLLM, the session's)
def test_mint_up_serving_vllm_with_a_chat_base(chat_base: Path, tmp_path: Path) -> None:
    """`mint up --serving vllm --base DIR`: the base is checked against the installed vLLM (its architectures)
    before anything starts, vLLM serves it with the base's own chat template, and the front answers chat with
    the prompt render_prompt gives."""
    require(vllm_available(VLLM_PYTHON), f"vLLM's environment {VLLM_PYTHON} (make vllm-venv)")
    config = ServicesConfig(
        state_dir=tmp_path / "run",
        serving="vllm",
        serve_base=str(chat_base),
        serve_port=free_port(),
        vllm_port=free_port(),
        vllm_python=VLLM_PYTHON,
    )
    try:
        start(config, ["vllm", "serve"])
        tok = AutoTokenizer.from_pretrained(chat_base, local_files_only=True)
        token = (config.state_dir / "serve.token").read_text().strip()  # serving keys are on in a stack
        oai = OpenAI(base_url=config.url("serve") + "/v1", api_key=token)
        chat = oai.chat.completions.create(
            model=chat_base.name,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
        )
        assert chat.usage is not None
        assert chat.usage.prompt_tokens == len(tok(render_prompt(tok, MESSAGES))["input_ids"])
        assert chat.choices[0].finish_reason in ("stop", "length")
    finally:
        stop(config, ["vllm", "serve"])
