"""The receiving side of handoff.py's merged-weights baseline: a bare inference process over one base model.

It stands for an inference server that takes full weights from a trainer (as TRL's GRPOTrainer pushes merged
LoRA weights into vLLM): it holds the base model, replaces its weights on request, and answers greedy tokens. It
answers through mint's own Engine (base requests, no adapter), so that both paths of handoff.py end in the same
forward code and differ only in how the new weights arrive.

Routes (loopback only, one request at a time):
  GET  /health
  POST /update_weights {"path": <safetensors file>, "revision": <str>}  read every tensor of the file and copy it
                                                                         into the parameter of the same name
  POST /generate {"prompt": [token ids], "max_tokens": n}               greedy; answers {"token_ids", "revision"}

    python benchmarks/_handoff_server.py --base DIR --port PORT [--dtype bfloat16] [--threads 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import torch
from safetensors import safe_open

from mint_core.engine.base import load_base
from mint_core.engine.engine import Engine, EngineConfig, Request
from mint_core.engine.sampling import SamplingParams


class Receiver:
    def __init__(self, base: str, dtype: torch.dtype, device: str = "cpu"):
        b = load_base(base, dtype=dtype, device=device)
        # state_dict() shares storage with the parameters (tied lm_head included): copying into it updates the
        # model. Taken before the engine wraps the linears (the wrappers keep these same weight tensors).
        self.params = b.model.state_dict()
        self.engine = Engine(b, EngineConfig(max_loras=1, max_lora_rank=1, max_model_len=64))
        self.revision = "base"

    @torch.inference_mode()
    def update_weights(self, path: str, revision: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        loaded, nbytes = 0, 0
        seen: set[int] = set()
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if key not in self.params:
                    raise KeyError(f"{key} is not a parameter of the model")
                t = f.get_tensor(key)
                dst = self.params[key]
                if t.shape != dst.shape:
                    raise ValueError(f"{key}: shape {tuple(t.shape)}, model has {tuple(dst.shape)}")
                dst.copy_(t)
                seen.add(dst.data_ptr())
                loaded += 1
                nbytes += t.numel() * t.element_size()
        missing = [k for k, v in self.params.items() if v.data_ptr() not in seen]
        if missing:
            raise ValueError(f"the update left {len(missing)} parameters out, e.g. {missing[:3]}")
        self.revision = revision
        return {"tensors": loaded, "bytes": nbytes, "seconds": time.perf_counter() - t0}

    def generate(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        (out,) = self.engine.generate([Request(prompt, None, params)])
        return {"token_ids": list(out.token_ids), "revision": self.revision}


def make_handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall

        def _answer(self, status: int, body: dict[str, Any] | None = None) -> None:
            data = json.dumps(body or {}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._answer(200, {"revision": receiver.revision})
            else:
                self._answer(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
            try:
                if self.path == "/update_weights":
                    self._answer(200, receiver.update_weights(body["path"], str(body["revision"])))
                elif self.path == "/generate":
                    self._answer(200, receiver.generate(list(body["prompt"]), int(body.get("max_tokens", 1))))
                else:
                    self._answer(404, {"error": f"no route {self.path}"})
            except Exception as e:  # the benchmark reports it and stops
                self._answer(500, {"error": f"{type(e).__name__}: {e}"})

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    receiver = Receiver(args.base, getattr(torch, args.dtype), args.device)
    httpd = HTTPServer(("127.0.0.1", args.port), make_handler(receiver))
    print(f"handoff receiver on http://127.0.0.1:{args.port}", file=sys.stderr, flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()


if __name__ == "__main__":
    main()
