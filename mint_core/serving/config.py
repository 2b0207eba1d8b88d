"""Settings of the embedded server, from a YAML/JSON file and MINT_SERVE_* environment variables."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from mint_core.settings import Settings
from mint_core.types import Device

ENV_PREFIX = "MINT_SERVE_"


class ServingConfig(Settings):
    """How `mint serve` runs: which base, which adapters may be loaded, limits and credentials.

    `ServingConfig.load(file, **flags)` reads the file, then MINT_SERVE_<FIELD> environment variables, then flags."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX)

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = Field(8000, ge=0, le=65535)
    """Port to bind (0: any free port)."""
    base: str = "tiny-dense"
    """A local Hugging Face model directory, or a built-in random base: tiny-dense, tiny-moe, tiny-mla, tiny-dsa."""
    served_model_name: str | None = None
    """The base's name in the API (`model` for requests with no adapter); default: the directory's name."""
    adapter_root: Path = Path(".mint/store")
    """`lora_path` of a load request must resolve inside this directory (the adapter store)."""
    catalog_url: str | None = None
    """SQLAlchemy URL of the adapter catalog; when set, `lora_path` may also be a catalog address
    (`policy@alias`, `policy/vN`), resolved to a revision of the adapter store."""
    loader_workers: int = Field(2, ge=1, le=64)
    """Threads that cold-load catalog addresses named by requests or prefetch (with catalog_url)."""
    api_key: SecretStr | None = None
    """If set, every /v1 route needs `Authorization: Bearer <api_key>` (as vLLM's --api-key)."""
    access_file: Path | None = None
    """The stack's access file (`mint_core.access`, `mint up` passes `<state dir>/access.json`): when set, every
    /v1 route and /metrics needs `Authorization: Bearer <key>`, a serving key of the file (read again when the file
    changes: rotation without a restart) or the admin token; a key calls only the policies its patterns match
    (403 otherwise) and `/v1/models` lists only those. Takes the place of `api_key`."""
    admin_token: SecretStr | None = None
    """Bearer token for load/unload; generated and printed at start when unset."""
    max_loras: int = Field(8, ge=1)
    """Device slots (adapters in one batch without a load)."""
    max_cpu_loras: int | None = Field(None, ge=1)
    """Host cache of adapter revisions (default 4 x max_loras)."""
    max_lora_rank: int = Field(16, ge=1)
    """Largest adapter rank accepted."""
    max_model_len: int = Field(1024, ge=8)
    """Longest prompt + completion in tokens."""
    max_num_seqs: int = Field(64, ge=1)
    """Most requests decoded together in one batch."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype of the base."""
    device: Device = "cpu"
    """Where the base, its adapter slots and every forward run: cpu, cuda or cuda:N (`mint serve --device`)."""
    torch_threads: int | None = Field(None, ge=1)
    """CPU threads for torch (default: torch's own choice). 1 keeps decode steady when the cores are shared with
    other busy processes, where OpenMP's spinning threads stall each other."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Server log level."""
    backend: Literal["mint", "vllm"] = "mint"
    """Who runs the model: `mint`, the embedded engine in this process; `vllm`, a vLLM server at `vllm_url` that
    this process fronts (validation, auth, revision identity; serving/gateway.py). The HTTP contract is the same."""
    vllm_url: str = "http://127.0.0.1:8100"
    """With backend vllm: the vLLM server's address, on loopback (only this front may reach it)."""
    vllm_api_key: SecretStr | None = None
    """With backend vllm: the key vLLM was started with (`--api-key`); users never see it."""
    vllm_routed_key: SecretStr | None = None
    """With a fleet: the key of the requests the front routes to the replicas, which they accept for inference only
    (VLLMConfig.routed_key); loads go to each replica with vllm_api_key. Unset: vllm_api_key."""
    vllm_replicas: list[str] = Field(default_factory=list)
    """With backend vllm and a fleet: every replica's address (`http://127.0.0.1:8100`, ...; JSON list in
    MINT_SERVE_VLLM_REPLICAS), in place of vllm_url. The front routes each request to one of them itself
    (consistent hashing on the served name, serving/fleet.py), and loads and unloads on each, all or nothing.
    Empty: one vLLM at vllm_url."""
    resolver_token: SecretStr | None = None
    """With backend vllm: the bearer token of mint's vLLM resolver plugin on `/v1/mint/resolve`."""
    golden_interval_s: float = Field(15.0, ge=0)
    """With backend vllm: seconds between golden probes of the vLLM replica (also one after every load through
    this front); 0 turns the probe off. A probe asks vLLM for the greedy answers to `golden_prompts` under the base
    and under one champion, recorded once when first seen; a replica whose answers change is taken out of rotation
    (503) and restarted by its supervisor (serving/golden.py)."""
    golden_prompts: list[str] = Field(
        default_factory=lambda: ["The capital of France is", "12+30 =", "Once upon a time"], min_length=1
    )
    """With backend vllm: the golden probe's prompts (greedy, `golden_max_tokens` tokens each)."""
    golden_max_tokens: int = Field(8, ge=1, le=64)
    """With backend vllm: tokens the golden probe generates per prompt."""
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    """Largest request body of a /v1 route, on both backends: 413 beyond, before any JSON is parsed. The default,
    4 MiB, holds a prompt far longer than any context mint serves; Tinker's routes (/api/v1) are not limited by it."""
    routing_dir: Path | None = None
    """Where `model: "auto"` (serving/routing.py) appends its route log (`log.jsonl`: each routed request, its
    features, choice and probability, and its reward when one comes) and the only place router revisions are loaded
    from (`router_path`, `PUT /v1/mint/router`). Default: `<adapter_root>/../routing`, the state dir's `routing/`."""
    router_path: Path | None = None
    """The router revision (a directory a router was saved to, inside routing_dir, relative or absolute) that
    routes `model: "auto"` from the start, or the router saved online that went on from it (route_save_interval_s);
    one that does not load stops the start. Unset: the router saved online, else a cold router, each arm that names
    a registered task warm-started from the task's held-out prompts."""
    route_cold_load_cost: float = Field(0.05, ge=0.0, le=1.0)
    """The cost, in reward units, of routing to an adapter the server does not hold yet (a catalog champion a
    request would have to cold-load): the router prefers a resident adapter unless the cold one's expected reward
    is higher by more than this. Resident adapters and the base cost 0."""
    route_seed: int | None = None
    """Seed of the router's exploration draws (reproducible runs); unset: drawn afresh each start."""
    route_save_interval_s: float = Field(60.0, ge=0)
    """How often the serving router, with what it learned online, is saved to `<routing_dir>/online` (when it
    changed since the last save; and once more at a clean shutdown), with the revision it serves as beside it
    (`online.json`). A server started again serves the router saved there (unless `router_path` names another
    revision than the one it went on from), so a restart keeps what was learned; one that does not load is refused,
    and the server starts as if there were none, saying why in its log. 0: never saved nor loaded from there."""
    tinker: bool = True
    """Also serve Tinker's training API (/api/v1/..., the `tinker` SDK) on the same engine."""
    tinker_api_keys: SecretStr | None = None
    """Comma-separated API keys (`tml-...`) of the Tinker API; keys of `tinker_api_keys_file` count too. Neither
    set: one key is generated and printed at start."""
    tinker_api_keys_file: Path | None = None
    """A file of Tinker API keys, one per line (optionally followed by an owner name)."""
    tinker_window_ms: float = Field(10.0, ge=0, le=10_000)
    """forward_backward calls of different training clients that arrive within this window run as one step."""
    tinker_lora_alpha: float = Field(32.0, gt=0)
    """LoRA alpha of the adapters trained through the Tinker API (scale = alpha / rank)."""
    tinker_state_dir: Path | None = None
    """Where the Tinker API keeps checkpoint indexes and optimizer states (default: <adapter_root>/../tinker)."""
    tinker_registry_uri: str | None = None
    """MLflow tracking URI: a named save_weights_for_sampler also becomes an MLflow version of its policy. Unset:
    saves go to the adapter store and the engine only."""
    tinker_catalog_url: str | None = None
    """Catalog that registered versions are indexed in (default: catalog_url, else a SQLite file in the
    Tinker state dir)."""
    tinker_keep_sampler_saves: int | None = Field(20, ge=1)
    """Each Tinker training run keeps its newest this many named save_weights_for_sampler checkpoints; an older one
    is deleted (engine, store ref, run record, and its MLflow version unless an alias holds it), so `mint catalog
    gc` frees its bytes. None (`null`): every save is kept until its client deletes it."""
    tinker_keep_snapshots: int = Field(4, ge=1)
    """Each Tinker training run keeps its newest this many unnamed snapshots (`save_weights_and_get_sampling_client`,
    which RL loops call every step); an older one is released (engine, store ref, checkpoint index) with the
    sampling sessions on it, and sampling from one of those answers 410 naming the snapshot. Raise it for RL loops
    that sample from policies more steps behind (tinker-cookbook's `max_steps_off_policy`)."""
    tinker_result_ttl_s: float = Field(600.0, gt=0)
    """A finished Tinker call's result stays retrievable (`retrieve_future`) this many seconds after it finished,
    and a finished or expired session (with its sampling sessions) is forgotten this long after it ended: until
    then a call on it answers 410, after it 404."""

    def tinker_keys(self) -> SecretStr:
        """The Tinker API keys as configured, or one generated now when none is."""
        if self.tinker_api_keys is None and self.tinker_api_keys_file is None:
            self.tinker_api_keys = SecretStr("tml-" + secrets.token_urlsafe(24))
        return self.tinker_api_keys or SecretStr("")

    def resolver_secret(self) -> str:
        if self.resolver_token is None:
            self.resolver_token = SecretStr(secrets.token_urlsafe(24))
        return self.resolver_token.get_secret_value()

    def routing_root(self) -> Path:
        """`routing_dir`, or its default beside the adapter store."""
        return (
            self.routing_dir if self.routing_dir is not None else Path(self.adapter_root).parent / "routing"
        )

    def admin_secret(self) -> str:
        if self.admin_token is None:
            self.admin_token = SecretStr(secrets.token_urlsafe(24))
        return self.admin_token.get_secret_value()
