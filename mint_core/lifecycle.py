"""What the lifecycle flows need from the library beyond single component calls: where everything is (the
workspace), the training run's identity (its idempotency key), the revision a server holds under a name, and a
served smoke check. Training itself is the one recipe in `mint_core.rl.recipe`, as for `mint train`.

Nothing here knows about Prefect: `tasks/` wraps these calls one step each, `flows/` strings them together.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx
import matplotlib
import matplotlib.pyplot as plt
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mint_core.data.revision import data_rev
from mint_core.data.spec import SpecError
from mint_core.data.spec import registry as task_registry
from mint_core.data.tasks import Example, Prompt, has_generator, read_jsonl, split
from mint_core.errors import MintError
from mint_core.registry.catalog import CHAMPION, Catalog, CatalogConfig
from mint_core.registry.index import new_holder
from mint_core.registry.leases import LOCK_URL_ENV, Leases, held, leases_for
from mint_core.registry.mlflow_registry import Registry, RegistryConfig, Revision, UnknownRevision
from mint_core.registry.runs import IDEMPOTENCY_TAG
from mint_core.registry.store import AdapterStore
from mint_core.serving.client import ServingClient, ServingError
from mint_core.types import Device

if TYPE_CHECKING:  # annotations only: the webhook receiver reconciles through this module and loads no torch
    from mint_core.rl.grpo import GRPOConfig
    from mint_core.rl.policy import PolicySpec

logger = logging.getLogger(__name__)
matplotlib.use("Agg")  # curves are drawn to files for MLflow, never shown

WORK_DIR_ENV = "MINT_WORK_DIR"
"""The `work_dir` of the flow runs a worker starts (its own working directory, per host)."""
WORKER_ENV = "MINT_WORKER_NAME"
"""The name of the worker whose process runs this flow run (set by `mint worker` / `mint up`)."""
FAULT_ENV = "MINT_LIFECYCLE_FAULT"
"""Comma-separated fault points (`point`, `point:N` for the N-th time it is reached, `...:kill` to SIGKILL the
process there instead of raising); for fault-injection tests only."""


class LifecycleError(MintError):
    """A lifecycle step could not finish; names the policy and what was found."""


class SmokeCheckFailed(LifecycleError):
    """The server does not answer with the revision it was just given under the policy's name."""


class InjectedFault(LifecycleError):
    """Raised at a fault point named in MINT_LIFECYCLE_FAULT (tests)."""


class Workspace(BaseModel):
    """Where the lifecycle reads and writes: the registry, the adapter store and catalog, the serving endpoint,
    the base, and local state (checkpoints, cached task results). No secrets: the admin token of the serving
    endpoint comes from MINT_SERVE_ADMIN_TOKEN or `admin_token_file`."""

    model_config = ConfigDict(extra="forbid")

    tracking_uri: str = Field(
        default_factory=lambda: os.environ.get("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    )
    """The MLflow tracking server and registry (default $MLFLOW_TRACKING_URI)."""
    store: str = ".mint/store"
    """Adapter store root (a directory or an fsspec URL); the serving endpoint must read the same store."""
    catalog_url: str = "sqlite:///.mint/catalog.db"
    """SQLAlchemy URL of the catalog index."""
    base: Path = Field(default_factory=lambda: _default_base())
    """The base model directory (with its tokenizer) that the served base was loaded from. Default: what
    `mint up` serves, data/base when `dvc repro` has built it, else .mint/run/tiny-dense."""
    serving_url: str = "http://127.0.0.1:8000"
    """Root of the serving endpoint (`mint serve` or vLLM)."""
    admin_token_file: Path | None = Path(".mint/run/serve.token")
    """File holding the admin token of the serving endpoint (what `mint up` writes); MINT_SERVE_ADMIN_TOKEN wins."""
    serving_path: Literal["digest", "path"] = "digest"
    """How a revision is named to the server: "digest" (`sha256:<hex>`, resolved in the server's own store, as
    `mint serve` does) or "path" (the store's local directory of the revision, for a vLLM sharing the disk)."""
    work_dir: Path = Field(default_factory=lambda: Path(os.environ.get(WORK_DIR_ENV) or ".mint/lifecycle"))
    """Training checkpoints (a killed run resumes from them) and Prefect's persisted task results (the cache of
    exports and evaluations): this host's own. Default $MINT_WORK_DIR (what a worker sets for the runs it starts,
    `mint worker --workdir`), else .mint/lifecycle."""
    checkpoint_url: str | None = None
    """Where training checkpoints are also kept for the other hosts: a directory or fsspec URL every worker
    reaches (`mint worker` sets `<store>/checkpoints` when the store is shared). A run that another host resumes
    (its first host died) starts from the newest checkpoint there. None: only in `work_dir`, so a run resumes from
    its checkpoints only on the host that wrote them."""
    run_lease_s: float = Field(60.0, gt=0)
    """A training flow run holds the lease `run/<flow run id>` in the catalog while it runs, renewed every third
    of this; a worker that starts again requeues the runs whose lease it held, or whose lease a dead host let
    expire (`mint_app.deployments.reclaim_runs`), and the resumed run waits out such a lease first."""
    device: Device = "cpu"
    """Where training loads the base and runs its updates: cpu, cuda or cuda:N."""
    lock_url: str | None = Field(
        default_factory=lambda: os.environ.get(LOCK_URL_ENV) or None, pattern=r"^rediss?://"
    )
    """Where leases live, the locks of registry writes and promotions (`mint_core.registry.leases`): None = the
    catalog (`catalog_url`); `redis://host:port/db` (or `rediss://`) = Redis. Default $MINT_LOCK_URL."""
    lock_hold_s: float = Field(300.0, gt=0)
    """Longest a promotion may hold its policy's lock; a holder that died frees it after this long."""

    @model_validator(mode="before")
    @classmethod
    def _redis_url_is_gone(cls, data: Any) -> Any:
        if isinstance(data, dict) and "redis_url" in data:
            raise ValueError(
                "workspace.redis_url is gone: locks are leases in the catalog unless `lock_url` names a Redis "
                "(lock_url: redis://host:port/db); rename the setting, or drop it to keep them in the catalog"
            )
        return data

    def registry(self) -> Registry:
        """The registry (MLflow + catalog + store) of this workspace; one per process and workspace."""
        key = self.model_dump_json()
        reg = _REGISTRIES.get(key)
        if reg is None:
            store = AdapterStore(self.store)
            catalog = Catalog(CatalogConfig(url=self.catalog_url))
            reg = Registry(
                store,
                catalog,
                RegistryConfig(tracking_uri=self.tracking_uri),
                leases_for(self.lock_url, catalog),
            )
            _REGISTRIES[key] = reg
        return reg

    def leases(self) -> Leases:
        """Where this workspace's locks live (`lock_url`): the registry's and the promotions' alike."""
        return self.registry().leases

    def admin_token(self) -> str | None:
        token = os.environ.get("MINT_SERVE_ADMIN_TOKEN")
        if token:
            return token
        if self.admin_token_file is not None and self.admin_token_file.is_file():
            return self.admin_token_file.read_text().strip() or None
        return None

    def client(self, timeout: float = 120.0) -> ServingClient:
        return ServingClient(
            self.serving_url,
            api_key=os.environ.get("MINT_SERVE_API_KEY"),
            admin_token=self.admin_token(),
            timeout=timeout,
        )

    def lora_path(self, digest: str) -> str:
        """How the serving endpoint is told where revision `digest` is."""
        if self.serving_path == "digest":
            return f"sha256:{digest}"
        return str(self.registry().store.local_dir(digest))


_REGISTRIES: dict[str, Registry] = {}


def _default_base() -> Path:
    builtin = Path("data/base")
    return builtin if (builtin / "config.json").is_file() else Path(".mint/run/tiny-dense")


# ---- data --------------------------------------------------------------------------------------------------


def round_seed(seed: int, round_name: str | None) -> int:
    """The seed of one training round: derived from the run's seed and the round's name, so every round draws
    its own prompts, adapter initialisation and rollout samples, and rerunning a round draws the same again.
    Without a round, the seed itself."""
    if round_name is None:
        return seed
    digest = hashlib.sha256(f"{seed}:{round_name}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def load_prompts(
    task: str, n: int, seed: int, data_dir: Path | None, round_name: str | None = None
) -> tuple[list[Example], str]:
    """`n` training examples of a task and where they came from: `data_dir/train/<task>.jsonl` (the DVC
    `task_data` output) when given, else generated from `seed`. Without a round, the first `n`; with one, `n`
    drawn without replacement by the round's seed (`round_seed`), in the order drawn: a new round trains on new
    prompts, the same round on the same ones. A task that no generator here makes (a user's spec) reads its
    spec's train file, wherever `data_dir` points: the first `n` rows (passes over the file when it has fewer),
    or, with a round, `n` in the order the round's seed shuffles them."""
    if not has_generator(task):
        spec = task_registry().get(task)
        rows = spec.train_rows()
        source = spec.resolve(spec.data.train)
        order = list(range(len(rows)))
        if round_name is not None:
            random.Random(round_seed(seed, round_name)).shuffle(order)
            source += f"#round={round_name}"
        return [rows[order[i % len(rows)]] for i in range(n)], source
    if data_dir is not None:
        path = Path(data_dir) / "train" / f"{task}.jsonl"
        if not path.is_file():
            raise LifecycleError(f"no training data for task {task!r} at {path} (run `dvc repro task_data`)")
        rows = read_jsonl(path)
        if len(rows) < n:
            raise LifecycleError(f"{path} has {len(rows)} examples; the run needs {n}")
        if round_name is None:
            return rows[:n], str(path)
        picked = random.Random(round_seed(seed, round_name)).sample(range(len(rows)), n)
        return [rows[i] for i in picked], f"{path}#round={round_name}"
    if round_name is None:
        return split(task, n, 0, seed)[0], f"generated:{task}:seed={seed}"
    rs = round_seed(seed, round_name)
    return split(task, n, 0, rs)[0], f"generated:{task}:seed={rs}"


def train_and_heldout(task: str, n: int, n_heldout: int, seed: int) -> tuple[list[Example], list[Example]]:
    """A standalone run's `n` train prompts and `n_heldout` held-out rows of a registered task (`mint train`): a
    generated task's distinct prompts at `seed` (ValueError when it has fewer); a user's task's train file
    (passes over it when it has fewer rows, shuffled by `seed`) and its held-out file's first rows."""
    if has_generator(task):
        return split(task, n, n_heldout, seed)
    spec = task_registry().get(task)
    train, _ = load_prompts(task, n, seed, None, round_name=f"train-{seed}")
    return train, spec.heldout_rows()[:n_heldout]


def with_replay(
    task: str,
    examples: list[Example],
    replay: float,
    seed: int,
    data_dir: Path | None,
    round_name: str | None = None,
) -> list[Example]:
    """`examples` with a `replay` share of them replaced by those of the tasks its gate guards (the spec's
    `gate.guards`; `PolicySpec.replay`), as
    evenly as the count allows, all drawn the way `load_prompts` draws (the train split: never an evaluated
    prompt), and shuffled by the round's seed so each step's slice carries about the same mix."""
    n_replay = round(len(examples) * replay)
    others = list(task_registry().get(task).gate.guards)
    if n_replay == 0 or not others:
        return examples
    mixed = list(examples[: len(examples) - n_replay])
    for i, other in enumerate(others):
        k = n_replay // len(others) + (i < n_replay % len(others))
        if k:
            mixed += load_prompts(other, k, seed, data_dir, round_name)[0]
    random.Random(round_seed(seed, round_name) + 1).shuffle(mixed)
    return mixed


def data_revision(data_dir: Path | None, sources: list[str], repo_root: Path = Path(".")) -> str:
    """`mint.data_rev` of a run: the DVC data revision when the prompts come from the DVC outputs (and
    dvc.lock is there), else a hash of the generated sources."""
    if data_dir is not None and (repo_root / "dvc.lock").is_file():
        return data_rev(repo_root)
    return "gen-" + hashlib.sha256("\n".join(sorted(sources)).encode()).hexdigest()[:12]


# ---- identity of a training run ------------------------------------------------------------------------


def idempotency_key(
    spec: PolicySpec,
    data_rev: str,
    grpo: GRPOConfig,
    steps: int,
    prompts_per_step: int,
    seed: int,
    base: str,
    round: str,
) -> str:
    """What makes two training runs one run: the policy, the data, the config, the schedule, the base and the
    round (a name the caller gives each round of retraining). Not the parent: a rerun after the run's own
    promotion must still find the version it made. Rerunning finds that version instead of training again."""
    doc = {
        "spec": spec.model_dump(mode="json"),
        "round": round,
        "data_rev": data_rev,
        "grpo": grpo.model_dump(mode="json"),
        "steps": steps,
        "prompts_per_step": prompts_per_step,
        "seed": seed,
        "base": base,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:24]


def find_by_key(registry: Registry, policy: str, key: str) -> Revision | None:
    """The version of `policy` a run with this idempotency key already made, if any."""
    try:
        revs = registry.revisions(policy)
    except UnknownRevision:
        return None  # no such policy yet
    found = [r for r in revs if r.tags.get(IDEMPOTENCY_TAG) == key]
    return found[0] if found else None


def champion(registry: Registry, policy: str) -> Revision | None:
    """The policy's champion, or None (no policy yet, or no champion)."""
    version = registry.alias_version(policy, CHAMPION)
    return None if version is None else registry.revision(policy, version)


# ---- training ----------------------------------------------------------------------------------------------


CURVE_PANELS = (
    ("reward", "mean rollout reward (band: ± its std)"),
    ("kl", "KL to the base (k3)"),
    ("entropy", "entropy (mean -logprob of samples)"),
    ("grad_norm", "gradient norm (before clipping)"),
)


def curve_figure(policy: str, curve: list[dict[str, float]]) -> Any:
    """One policy's training as a matplotlib figure for its MLflow run: its reward (with its spread), its KL to
    the base, its entropy and its gradient norm, per GRPO step."""
    fig, axes = plt.subplots(2, 2, figsize=(8, 5), sharex=True)
    steps = list(range(1, len(curve) + 1))
    for ax, (key, title) in zip(axes.flat, CURVE_PANELS, strict=True):
        ys = [float("nan") if p.get(key) is None else p[key] for p in curve]
        ax.plot(steps, ys, marker="o", markersize=2)
        if key == "reward" and any(p.get("reward_std") is not None for p in curve):
            sd = [p.get("reward_std") or 0.0 for p in curve]
            ax.fill_between(
                steps,
                [y - d for y, d in zip(ys, sd, strict=True)],
                [y + d for y, d in zip(ys, sd, strict=True)],
                alpha=0.2,
            )
        ax.set_title(title, fontsize=9)
    for ax in axes[1]:
        ax.set_xlabel("GRPO step")
    fig.suptitle(policy)
    fig.tight_layout()
    plt.close(fig)
    return fig


# ---- serving ----------------------------------------------------------------------------------------------


def served_revision(client: ServingClient, name: str) -> str | None:
    """The revision (`sha256:<hex>`) the server holds under `name`, or None when it holds none."""
    card = next((m for m in client.models() if m.get("id") == name), None)
    return None if card is None else card.get("revision")


SMOKE_FALLBACK = "Hello"
"""What a smoke check asks a revision no registered task made (a Tinker client's saved weights): any answer
from the right revision will do."""


def smoke_prompt(task: str | None) -> Prompt:
    """What a smoke check asks a revision of `task` (its `mint.task` tag): the task's first held-out row, as its
    callers ask it (text, or chat messages); `SMOKE_FALLBACK` for no task or one not registered here."""
    reg = task_registry()
    if task is None or task not in reg:
        return SMOKE_FALLBACK
    try:
        return reg.get(task).heldout_rows()[0].prompt
    except SpecError as e:
        logger.info("smoke check of a %s revision asks %r: %s", task, SMOKE_FALLBACK, e)
        return SMOKE_FALLBACK


def smoke_check(client: ServingClient, name: str, digest: str, prompt: Prompt = SMOKE_FALLBACK) -> float:
    """One greedy answer to `prompt` (`smoke_prompt`: a held-out prompt of the revision's own task) under `name`;
    it must be answered by revision `digest`. Returns its latency in s."""
    want = f"sha256:{digest}"
    listed = served_revision(client, name)
    if listed != want:
        raise SmokeCheckFailed(f"{client.base_url} lists {name!r} as {listed}, expected {want}")
    t0 = time.perf_counter()
    try:
        _, fingerprint = client.ask(name, prompt, direct=True, max_tokens=4, temperature=0.0)
    except ServingError as e:
        raise SmokeCheckFailed(f"{client.base_url}: a completion under {name!r} failed: {e}") from e
    got = str(fingerprint)
    if got.removeprefix("sha256:") != digest:  # mint serve names the revision by its bare hex digest
        raise SmokeCheckFailed(f"{client.base_url} answered {name!r} with revision {got}, expected {want}")
    return time.perf_counter() - t0


def promotion_lock(policy: str) -> str:
    """The lease that serialises everything that changes what `policy` serves: promotions, rollbacks,
    reconciles (the key of the flows' SERIALIZABLE transactions, and what the webhook receiver takes)."""
    return f"promote-{policy}"


@contextmanager
def policy_lock(ws: Workspace, policy: str, holder: str, timeout_s: float | None = 60.0) -> Iterator[None]:
    """Hold `policy`'s promotion lock for the block, outside Prefect (the flows' SERIALIZABLE transactions take
    the same lease); `mint_core.registry.leases.LockTimeout` when it stays taken for `timeout_s`."""
    with held(ws.leases(), promotion_lock(policy), new_holder(holder), timeout_s, ws.lock_hold_s):
        yield


RUN_LEASE_PREFIX = "run/"
"""The lease a training flow run holds while it runs: `run/<flow run id>` (`held_run`)."""


def run_lease(flow_run_id: str) -> str:
    return f"{RUN_LEASE_PREFIX}{flow_run_id}"


def run_holder() -> str:
    """Who holds a run's lease: the worker that started this process (`WORKER_ENV`; `local` outside a worker),
    then the machine and process, so a worker that starts again knows the leases its dead runs held."""
    return new_holder(os.environ.get(WORKER_ENV) or "local")


def holder_worker(holder: str) -> str:
    """The worker named in a `run_holder()` string."""
    return holder.split("@", 1)[0]


@contextmanager
def held_run(ws: Workspace, flow_run_id: str, wait_s: float | None = None) -> Iterator[str]:
    """Hold `run/<flow_run_id>` for the block, renewed every third of `ws.run_lease_s` by a thread, so the catalog
    says the run is alive while its process is; a run whose host died lets it expire, and a worker then requeues
    it (`mint_app.deployments.reclaim_runs`). A run started again waits out its dead attempt's lease (`wait_s`,
    default three lease lengths); `LockTimeout` when another live process still holds it. Yields the holder."""
    # the catalog's leases (or Redis's) without the registry: holding a run's lease needs no MLflow
    catalog = Catalog(CatalogConfig(url=ws.catalog_url))
    try:
        leases = leases_for(ws.lock_url, catalog)
        name, holder, hold = run_lease(flow_run_id), run_holder(), ws.run_lease_s
        before = leases.holder(name)
        if before is not None:
            logger.info("run lease %s held by %s (an earlier attempt); waiting for it", name, before)
        with (
            held(leases, name, holder, 3 * hold if wait_s is None else wait_s, hold),
            _renewed(leases, name, holder, hold),
        ):
            yield holder
    finally:
        catalog.close()


@contextmanager
def _renewed(leases: Leases, name: str, holder: str, hold: float) -> Iterator[None]:
    """Renew a held lease every third of `hold` from a thread for the block."""
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(hold / 3):
            try:
                if not leases.acquire(name, holder, 0, hold):
                    logger.error("lease %s was taken by %s", name, leases.holder(name))
            except Exception as e:  # a catalog hiccup: the next renewal tries again, well within `hold`
                logger.warning("could not renew lease %s: %s", name, e)

    thread = threading.Thread(target=renew, name=f"renew-{name}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=hold)


class Reconciliation(BaseModel):
    """One policy's serving brought in line with its `champion` alias."""

    policy: str
    champion: int | None
    """The version MLflow's `champion` names (None: unset; serving is then left as it is)."""
    served_before: str | None
    """`sha256:<hex>` served under the policy's name before (None: not loaded)."""
    served_after: str | None
    reloaded: bool
    alias_synced: bool
    """The catalog's alias had to follow a move made in MLflow directly."""


def reconcile(ws: Workspace, policy: str, name: str | None = None) -> Reconciliation:
    """Follow the registry for one policy: sync the catalog's `champion` with MLflow's, and when the server holds
    another revision under `name` (default: the policy's name), load the champion in place and smoke-check it.
    Idempotent; the caller holds `policy_lock` (or the flows' transaction on `promotion_lock`)."""
    name = name or policy
    reg = ws.registry()
    synced = reg.sync_alias(policy, CHAMPION) is not None
    version = reg.alias_version(policy, CHAMPION)
    with ws.client() as client:
        before = served_revision(client, name)
        after, reloaded = before, False
        if version is not None:
            rev = reg.revision(policy, version)
            digest = rev.digest
            if before != f"sha256:{digest}":
                client.load_adapter(name, ws.lora_path(digest), inplace=True)
                smoke_check(client, name, digest, smoke_prompt(rev.tags.get("mint.task")))
                after, reloaded = f"sha256:{digest}", True
    return Reconciliation(
        policy=policy,
        champion=version,
        served_before=before,
        served_after=after,
        reloaded=reloaded,
        alias_synced=synced,
    )


def prefetch_route(client: ServingClient) -> bool:
    """Whether the server has mint's `POST /v1/mint/prefetch` (and a catalog behind it)."""
    try:
        r = httpx.get(client.base_url + "/openapi.json", timeout=5)
        return r.status_code == 200 and "/v1/mint/prefetch" in r.json().get("paths", {})
    except (httpx.HTTPError, ValueError):
        return False


def prefetch(client: ServingClient, addresses: list[str], wait: bool = True) -> dict[str, Any]:
    """Ask the server to cold-load catalog addresses ahead of need (mint's extension route)."""
    headers = {"Authorization": f"Bearer {client.admin_token}"} if client.admin_token else {}
    r = httpx.post(
        client.base_url + "/v1/mint/prefetch",
        json={"addresses": addresses, "wait": wait},
        headers=headers,
        timeout=300,
    )
    if r.status_code >= 400:
        raise ServingError(
            r.status_code, "PrefetchError", r.text[:500], client.base_url + "/v1/mint/prefetch"
        )
    return dict(r.json())


# ---- fault injection (tests) -----------------------------------------------------------------------------

_FAULT_HITS: dict[str, int] = {}


def fault(point: str) -> None:
    """Fail here if MINT_LIFECYCLE_FAULT names this point: raise `InjectedFault`, or with `:kill` end the
    process with SIGKILL (no cleanup, no rollback: a crash). `point:N` fires on the N-th time only."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    _FAULT_HITS[point] = _FAULT_HITS.get(point, 0) + 1
    for item in spec.split(","):
        parts = item.strip().split(":")
        if not parts or parts[0] != point:
            continue
        kill = "kill" in parts[1:]
        counts = [int(p) for p in parts[1:] if p.isdigit()]
        if counts and counts[0] != _FAULT_HITS[point]:
            continue
        logger.warning("injected fault at %s (%s)", point, "kill" if kill else "raise")
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedFault(f"injected fault at {point}")
