"""mint's seal middleware for vLLM (vllm_plugin/mint_vllm_seal.py) as an ASGI app: what it lets through. The real
vLLM behind it is tried route by route in tests/integration/test_vllm_seal.py."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import pytest

SPEC = importlib.util.spec_from_file_location(
    "mint_vllm_seal", Path(__file__).resolve().parents[2] / "vllm_plugin" / "mint_vllm_seal.py"
)
assert SPEC is not None and SPEC.loader is not None
seal = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(seal)
KEY = "k3y"


def call(mw: Any, scope: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """What the middleware sent, and whether it passed the request on."""
    sent: list[dict[str, Any]] = []
    passed = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        passed.append(scope)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    mw.app = app
    asyncio.run(mw(scope, receive, send))
    return sent, bool(passed)


def http(path: str, method: str = "GET", auth: bytes | None = None) -> dict[str, Any]:
    headers = [(b"authorization", auth)] if auth is not None else []
    return {"type": "http", "method": method, "path": path, "headers": headers}


@pytest.mark.parametrize(
    ("case", "scope", "passes"),
    [
        ("the key", http("/adapters", "POST", b"Bearer k3y"), True),
        ("the key, scheme in any case", http("/adapters", "POST", b"bearer k3y"), True),
        ("no header", http("/adapters", "POST"), False),
        ("a wrong key", http("/v1/load_lora_adapter", "POST", b"Bearer nope"), False),
        ("the key without its scheme", http("/adapters", "POST", b"k3y"), False),
        ("basic auth", http("/adapters", "POST", b"Basic k3y"), False),
        ("a prefix of the key", http("/health", "GET", b"Bearer k3"), False),
        ("/health unkeyed", http("/health"), False),
        ("OPTIONS unkeyed", http("/adapters", "OPTIONS"), False),
        ("a path nobody serves", http("/no/such"), False),
        ("lifespan", {"type": "lifespan"}, True),
    ],
)
def test_only_requests_with_mints_key_pass(case: str, scope: dict[str, Any], passes: bool) -> None:
    sent, passed = call(seal.Seal(None, key=KEY), scope)
    assert passed is passes, case
    if not passes:
        assert sent[0]["status"] == 401 and b"mint's key" in sent[1]["body"], case


def test_a_websocket_without_the_key_is_closed_before_it_is_accepted() -> None:
    sent, passed = call(
        seal.Seal(None, key=KEY), {"type": "websocket", "path": "/v1/realtime", "headers": []}
    )
    assert not passed and sent == [{"type": "websocket.close", "code": 1008}]


def test_without_a_key_vllm_does_not_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is not set"):
        seal.Seal(None)
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    assert call(seal.Seal(None), http("/x", auth=b"Bearer k3y"))[1]


def test_a_replica_names_itself_on_every_answer_refusals_included(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(seal.REPLICA_ENV, "127.0.0.1:8101")
    mw = seal.Seal(None, key=KEY)
    sent, passed = call(mw, http("/adapters", "POST"))
    assert not passed
    assert (b"x-mint-replica", b"127.0.0.1:8101") in sent[0]["headers"]

    answered: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        )
        await send({"type": "http.response.body", "body": b"ok"})

    async def send(message: dict[str, Any]) -> None:
        answered.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    mw.app = app
    asyncio.run(mw(http("/v1/models", auth=f"Bearer {KEY}".encode()), receive, send))
    assert answered[0]["headers"] == [
        (b"content-type", b"text/plain"),
        (b"x-mint-replica", b"127.0.0.1:8101"),
    ]


def test_a_single_vllm_adds_no_header(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(seal.REPLICA_ENV, raising=False)
    sent, _ = call(seal.Seal(None, key=KEY), http("/adapters", "POST"))
    assert all(name != b"x-mint-replica" for name, _ in sent[0]["headers"])


@pytest.mark.parametrize(
    ("method", "path", "passes"),
    [
        ("POST", "/v1/completions", True),
        ("POST", "/v1/chat/completions", True),
        ("GET", "/v1/models", True),
        ("POST", "/v1/load_lora_adapter", False),
        ("POST", "/v1/unload_lora_adapter", False),
        ("POST", "/adapters", False),
        ("DELETE", "/adapters/x", False),
        ("GET", "/metrics", False),
        ("POST", "/tokenize", False),
        ("GET", "/v1/completions", False),
    ],
)
def test_the_routed_key_opens_inference_only(method: str, path: str, passes: bool) -> None:
    mw = seal.Seal(None, key=KEY, routed_key="r0uted")
    assert call(mw, http(path, method, b"Bearer r0uted"))[1] is passes
    assert call(mw, http(path, method, f"Bearer {KEY}".encode()))[1]  # the full key opens everything


def test_the_seal_key_wins_over_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(seal.SEAL_KEY_ENV, "full")
    monkeypatch.delenv(seal.KEY_ENV, raising=False)
    mw = seal.Seal(None)
    assert call(mw, http("/adapters", "POST", b"Bearer full"))[1]
