"""The seal on a vLLM that mint starts (vllm_plugin/mint_vllm_seal.py): every route of the real vLLM, `/adapters`
included, refuses a request without mint's key.

The routes are read at run time, twice: vLLM's app is built in vLLM's own environment from the very command line
mint starts it with (every Route, APIRoute and Mount, schema or not), and the live server's `/openapi.json` is read
with the key. A hard-coded list of the routes that must never answer unkeyed is tried on top, so a vLLM upgrade
that drops one from the enumeration cannot make the test pass vacuously.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest

from mint_core.engine.base import load_base
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_testkit.harness import VLLM_KEY, VLLM_PYTHON, vllm_command
from tests.integration.conftest import VLLMServer

pytestmark = pytest.mark.integration

# Builds vLLM's FastAPI app exactly as `vllm.entrypoints.openai.api_server` does for these arguments (no engine)
# and prints its routes: [kind, path, methods].
ROUTES_SCRIPT = """
import json, sys
from starlette.routing import Mount
from vllm.entrypoints.launchers.app import build_app
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
app = build_app(args, ("generate",))
print(json.dumps([[type(r).__name__, r.path, sorted(getattr(r, "methods", None) or [])] for r in app.routes]))
"""

# Never to answer without mint's key, whatever vLLM's route table says: the adapter routes first (the poisoning of
# issue #34), then vLLM's other unkeyed surface, its keyed routes, and paths that do not exist at all.
MUST_REFUSE = [
    ("POST", "/adapters"),
    ("DELETE", "/adapters/evil"),
    ("OPTIONS", "/adapters"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/invocations"),
    ("GET", "/ping"),
    ("POST", "/ping"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/metrics/"),
    ("GET", "/version"),
    ("GET", "/load"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/inference/v1/generate"),
    ("GET", "/no/such/route"),
]


def vllm_routes(server: VLLMServer) -> set[tuple[str, str]]:
    """(method, path) of every route vLLM's app has for mint's command line, read in vLLM's environment."""
    port = int(server.vllm_url.rsplit(":", 1)[1])
    cmd, env = vllm_command(server.base_dir, port, None)
    args = cmd[cmd.index("vllm.entrypoints.openai.api_server") + 1 :]
    run_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", ROUTES_SCRIPT, *args],
        env={**run_env, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    routes = json.loads(done.stdout.strip().splitlines()[-1])
    out = set()
    for kind, path, methods in routes:
        for method in methods or (["GET", "POST"] if kind == "Mount" else []):
            out.add((method, path))
    return out


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)


def test_every_route_of_a_mint_started_vllm_refuses_a_request_without_the_key(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    server = vllm_server
    key = {"Authorization": f"Bearer {VLLM_KEY}"}
    enumerated = vllm_routes(server)
    assert ("POST", "/adapters") in enumerated, sorted(
        enumerated
    )  # the enumeration sees the SageMaker routes
    with httpx.Client(base_url=server.vllm_url, timeout=60, trust_env=False) as h:
        schema = h.get("/openapi.json", headers=key)
        assert schema.status_code == 200, schema.text  # the key opens what it seals
        live = {(m.upper(), p) for p, ops in schema.json()["paths"].items() for m in ops}
        tried = enumerated | live | set(MUST_REFUSE)
        assert len(tried) >= 40, sorted(tried)

        # a healthy adapter for the unkeyed load attempts: refused for want of the key, not for its content
        base = load_base(server.base_dir)
        adapter = tmp_path / "evil"
        save_adapter(
            random_adapter(base.sites, ["q_proj"], 8, seed=3, base_fingerprint=base.fingerprint),
            adapter,
            base.sites,
        )
        body = {
            "name": "evil",
            "src": str(adapter),
            "lora_name": "evil",
            "lora_path": str(adapter),
            "model": server.base_dir.name,
            "prompt": "hi",
            "max_tokens": 1,
        }
        answers = {}
        for method, path in sorted(tried):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": VLLM_KEY}):
                r = h.request(method, concrete(path), json=body, headers=headers)
                answers[(method, path, headers.get("Authorization", ""))] = r.status_code
                if r.status_code == 401 and method != "HEAD":
                    assert "mint's key" in r.text, (method, path, r.text)  # the seal answered, not vLLM
        not_refused = {k: v for k, v in answers.items() if v != 401}
        assert not not_refused, not_refused

        # with the key, mint gets through, and nothing the attempts sent was registered
        assert h.get("/health", headers=key).status_code == 200
        listed = {m["id"] for m in h.get("/v1/models", headers=key).json()["data"]}
        assert "evil" not in listed, listed
