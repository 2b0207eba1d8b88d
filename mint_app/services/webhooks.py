"""The receiver of MLflow's alias webhook: serving follows a `champion` moved anywhere within seconds.

A person moves `policy@champion` in the MLflow UI (or with a bare `MlflowClient`); MLflow posts
`model_version_alias.created` (or `.deleted`) here, signed with the secret `mint up` gave it. The receiver checks
the signature (HMAC-SHA256, constant-time, timestamp at most `max_age_s` old), then reconciles that one policy in
this process through the library (`mint_core.lifecycle.reconcile`: registry -> champion digest -> in-place load
under the policy's served name -> smoke check), holding the policy's promotion lock, the catalog lease the
promote, rollback and reconcile flows take. It speaks to any server of the serving contract (`mint serve`, vLLM),
so it is a service of its own (`hooks` in `mint up`), not part of `mint serve`; it loads no torch.

The router of `model: "auto"` (`mint-router`, not a policy) is followed the same way: its `champion` moved, the
server is given that router revision (`mint_core.lifecycle.routers.reconcile_router`: download, load, `PUT
/v1/mint/router`); a version that does not load is refused (200 with `refused`, logged as an error: a retry would
not help), and the server keeps its router.

Answers: 401 for a missing, wrong or stale signature (nothing changes); 200 with what was done, or with
`ignored` for an event it has nothing to do for (another alias, an unknown policy or version, a test delivery);
503 when MLflow, the server or the lock is not available right now, 500 when the reconcile failed otherwise:
MLflow retries both (3 times, backing off).

A missed event (the receiver was down, MLflow gave up retrying, an alias moved while the webhook was off) is caught
by the receiver's own sweep: every `sweep_s` seconds it reconciles every policy and the router in this process, the
same pass under the same locks, and logs only what it changed or could not do. A pass where nothing moved is a few
reads of MLflow, the catalog and the server; the `reconcile` deployment (infra/prefect.yaml) does the same pass as
a Prefect flow run, a new process each time, on a longer interval, as the net for when the receiver is not running.

Run: `python -m mint_app.services.webhooks` (what `mint up` supervises), configured by MINT_HOOKS_<FIELD> variables.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from anyio import to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from mint_core.lifecycle.leases import policy_lock
from mint_core.lifecycle.reconcile import Reconciliation, reconcile
from mint_core.lifecycle.routers import RouterReconciliation, reconcile_router
from mint_core.lifecycle.workspace import Workspace
from mint_core.registry.catalog import CHAMPION
from mint_core.registry.leases import LockTimeout
from mint_core.registry.reader import RegistryError, RegistryUnavailable, UnknownRevision
from mint_core.registry.routers import ROUTER_MODEL, RouterRefused
from mint_core.registry.webhooks import (
    ALIAS_EVENTS,
    DELIVERY_ID_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    BadSignature,
    verify,
)
from mint_core.serving.client import ServingError
from mint_core.settings import Settings

logger = logging.getLogger("mint.hooks")

ENV_PREFIX = "MINT_HOOKS_"
WEBHOOK_PATH = "/mlflow/webhook"


class HooksConfig(Settings):
    """Where the receiver listens, which secret signs MLflow's deliveries, and the workspace it reconciles in.

    `HooksConfig.load(file, **flags)` reads the file, then MINT_HOOKS_<FIELD> variables (MINT_HOOKS_WORKSPACE
    as JSON), then flags."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX)

    host: str = "127.0.0.1"
    """Address the receiver binds to (MLflow's server must reach it)."""
    port: int = Field(8001, ge=1, le=65535)
    """Port of the receiver."""
    secret_file: Path = Path(".mint/run/hooks.secret")
    """File holding the webhook secret (what `mint up` writes and registers with MLflow)."""
    max_age_s: float = Field(300.0, gt=0)
    """A delivery whose X-MLflow-Timestamp is further than this from now is refused (a replay)."""
    lock_timeout_s: float = Field(20.0, gt=0)
    """Longest wait for the policy's promotion lock (a promotion in flight); then 503 and MLflow retries."""
    sweep_s: float = Field(30.0, ge=0)
    """Seconds between the receiver's own reconcile passes over every policy and the router (the net for a missed
    event); 0 turns the sweep off."""
    sweep_lock_timeout_s: float = Field(1.0, gt=0)
    """Longest a sweep waits for a policy's promotion lock; a policy whose lock is held (a promotion in flight,
    which refreshes serving itself) is left to the next pass."""
    served_names: dict[str, str] = Field(default_factory=dict)
    """Policy -> the adapter name it is served under, where that is not the policy's own name."""
    workspace: Workspace = Field(default_factory=Workspace)
    """The registry, catalog (its promotion locks), store and serving endpoint, as the flows see them."""

    def secret(self) -> str:
        try:
            secret = self.secret_file.read_text().strip()
        except OSError as e:
            raise RuntimeError(f"cannot read the webhook secret {self.secret_file}: {e.strerror or e}") from e
        if not secret:
            raise RuntimeError(f"the webhook secret file {self.secret_file} is empty")
        return secret


def create_app(config: HooksConfig) -> FastAPI:
    """The receiver's ASGI app: `POST /mlflow/webhook`, `GET /health`; while it is served, its sweep every
    `config.sweep_s` seconds (`Sweeper`)."""
    secret = config.secret()
    # one reconcile per policy at a time in this process (the catalog lease serialises across processes); a burst
    # of moves coalesces: each pass reads MLflow's current alias, so later ones find nothing left to do
    guards: dict[str, threading.Lock] = {}
    guards_lock = threading.Lock()

    def guard(policy: str) -> threading.Lock:
        with guards_lock:
            return guards.setdefault(policy, threading.Lock())

    sweeper = Sweeper(config, guard)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        sweeper.start()
        try:
            yield
        finally:
            sweeper.stop()

    app = FastAPI(title="mint webhook receiver", docs_url=None, redoc_url=None, lifespan=lifespan)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post(WEBHOOK_PATH)
    async def mlflow_webhook(request: Request) -> JSONResponse:
        body = await request.body()
        h = request.headers
        try:
            verify(
                secret,
                h.get(SIGNATURE_HEADER),
                h.get(DELIVERY_ID_HEADER),
                h.get(TIMESTAMP_HEADER),
                body,
                config.max_age_s,
            )
        except BadSignature as e:
            logger.warning(
                "refused a delivery from %s: %s", request.client.host if request.client else "?", e
            )
            return JSONResponse({"error": f"bad signature: {e}"}, status_code=401)
        try:
            event = json.loads(body)
            kind = f"{event['entity']}.{event['action']}"
            data = event["data"]
            policy, alias = str(data["name"]), str(data["alias"])
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("ignored a signed delivery that is not an alias event: %s", e)
            return JSONResponse({"ignored": "not an alias event"}, status_code=200)
        if kind not in ALIAS_EVENTS or alias != CHAMPION:
            return JSONResponse({"ignored": f"{kind} of {policy}@{alias}: serving follows {CHAMPION}"})
        # blocking work (HTTP to MLflow and the server, the lock) runs off the event loop
        return await _in_thread(
            _handle, config, guard, policy, data.get("version"), kind, h.get(DELIVERY_ID_HEADER)
        )

    return app


class Sweeper:
    """The receiver's net for a missed event: every `sweep_s` seconds, one reconcile pass over every policy the
    registry holds and the router, each under its guard in this process and its promotion lock (waiting at most
    `sweep_lock_timeout_s`: a policy being promoted is left to the next pass). Logs what it changed and what
    failed, nothing for a policy already in line; a failure never stops the sweep."""

    def __init__(self, config: HooksConfig, guard: Callable[[str], threading.Lock]):
        self.config = config
        self.guard = guard
        self.passes = 0
        self._failing: dict[str, str] = {}  # policy -> the failure last logged for it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.config.sweep_s <= 0 or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="mint-hooks-sweep", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(self.config.sweep_s):
            self.tick()

    def tick(self) -> dict[str, str] | None:
        """One pass as the loop runs it: `sweep`'s report, or None when the pass could not list the policies
        (MLflow unreachable, say), logged once while that lasts; the next pass tries again."""
        try:
            out = self.sweep()
        except Exception as e:
            self._failed("", e)
            return None
        if self._failing.pop("", None) is not None:
            logger.info("sweep: the policies are listed again")
        return out

    def sweep(self) -> dict[str, str]:
        """One pass: policy (or the router) -> "reloaded", "in line", "busy" (its lock held), "ignored: ..." (a
        registered model that is no mint policy) or "failed: ..."."""
        ws = self.config.workspace
        out: dict[str, str] = {}
        for policy in [*ws.registry().policies(), ROUTER_MODEL]:
            out[policy] = self._one(ws, policy)
        self.passes += 1
        return out

    def _one(self, ws: Workspace, policy: str) -> str:
        router = policy == ROUTER_MODEL
        try:
            with self.guard(policy), policy_lock(ws, policy, "hooks-sweep", self.config.sweep_lock_timeout_s):
                if router:
                    r: Reconciliation | RouterReconciliation = reconcile_router(ws, policy)
                else:
                    r = reconcile(ws, policy, self.config.served_names.get(policy, policy))
        except LockTimeout:
            return "busy"
        except RegistryError as e:
            if isinstance(e, RegistryUnavailable):
                return self._failed(policy, e)
            # a registered model that is no mint policy (its champion has no mint.digest): nothing to serve
            if self._failing.get(policy) != (said := f"ignored: {e}"):
                logger.info("sweep: %s %s", policy, said)
                self._failing[policy] = said
            return said
        except Exception as e:
            return self._failed(policy, e)
        if self._failing.pop(policy, None) is not None:
            logger.info("sweep: %s reconciles again", policy)
        if not r.reloaded:
            return "in line"
        logger.info("sweep: %s: serving %s -> %s", policy, r.served_before, r.served_after)
        return "reloaded"

    def _failed(self, policy: str, e: Exception) -> str:
        """Logged once per failure, not every pass it lasts: as a warning when it is a service not answering
        right now (the server still starting, MLflow restarting: the next pass tries again), else an error."""
        failure = f"failed: {type(e).__name__}: {e}"
        if self._failing.get(policy) != failure:
            level = logging.WARNING if _unavailable(e) else logging.ERROR
            logger.log(level, "sweep: reconcile of %s %s", policy or "the policies (listing them)", failure)
            self._failing[policy] = failure
        return failure


def _unavailable(e: BaseException) -> bool:
    """A service that does not answer right now, rather than a reconcile that cannot succeed: a delivery gets 503
    for it (MLflow retries), the sweep a warning."""
    if isinstance(e, ServingError):
        return e.status in (0, 429, 502, 503, 504)
    return isinstance(e, RegistryUnavailable | LockTimeout | OSError)


def _handle(
    config: HooksConfig,
    guard: Callable[[str], threading.Lock],
    policy: str,
    version: Any,
    kind: str,
    delivery: str | None,
) -> JSONResponse:
    """One alias event: reconcile the server with the policy's (or the router's) champion, under the policy's
    guard in this process and its lease across processes; the answer says what changed or why nothing did."""
    t0 = time.perf_counter()
    ws = config.workspace
    name = config.served_names.get(policy, policy)
    router = policy == ROUTER_MODEL
    r: Reconciliation | RouterReconciliation
    try:
        if version is not None and not router:  # the version the event names must be a revision of the policy
            ws.registry().revision(policy, int(version))
        with guard(policy), policy_lock(ws, policy, "hooks", config.lock_timeout_s):
            r = reconcile_router(ws, policy) if router else reconcile(ws, policy, name)
    except RouterRefused as e:  # the champion does not load: the server keeps its router
        logger.error("%s %s v%s (delivery %s): refused: %s", kind, policy, version, delivery, e)
        return JSONResponse({"refused": str(e), "policy": policy})
    except UnknownRevision as e:
        logger.info("%s %s (delivery %s): ignored: %s", kind, policy, delivery, e)
        return JSONResponse({"ignored": str(e)})
    except RegistryError as e:
        if isinstance(e, RegistryUnavailable):
            return _failed(503, policy, delivery, e)
        # a version that is not a mint revision (no mint.digest), say: nothing to serve
        logger.info("%s %s (delivery %s): ignored: %s", kind, policy, delivery, e)
        return JSONResponse({"ignored": str(e)})
    except ValueError as e:  # a version that is not a number
        logger.info("%s %s (delivery %s): ignored: %s", kind, policy, delivery, e)
        return JSONResponse({"ignored": str(e)})
    except (LockTimeout, OSError) as e:
        return _failed(503, policy, delivery, e)
    except ServingError as e:
        return _failed(503 if _unavailable(e) else 500, policy, delivery, e)
    except Exception as e:  # a smoke check that failed, a bad adapter: MLflow retries, the flow is the net
        return _failed(500, policy, delivery, e)
    ms = (time.perf_counter() - t0) * 1000
    if r.reloaded:
        logger.info(
            "%s %s v%s (delivery %s): serving %s -> %s in %.0f ms",
            kind,
            policy,
            version,
            delivery,
            r.served_before,
            r.served_after,
            ms,
        )
    else:
        logger.info("%s %s v%s (delivery %s): serving already in line", kind, policy, version, delivery)
    return JSONResponse({**r.model_dump(), "ms": round(ms, 1)})


async def _in_thread(fn: Any, *args: Any) -> JSONResponse:
    # anyio's default thread limiter (40) bounds the passes running at once
    result: JSONResponse = await to_thread.run_sync(fn, *args)
    return result


def _failed(status: int, policy: str, delivery: str | None, e: BaseException) -> JSONResponse:
    logger.error("reconcile of %s (delivery %s) failed: %s: %s", policy, delivery, type(e).__name__, e)
    return JSONResponse({"error": f"{type(e).__name__}: {e}", "policy": policy}, status_code=status)


def main() -> None:
    """`python -m mint_app.services.webhooks`: serve the receiver with MINT_HOOKS_* settings until SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # the sweep's reads of MLflow and the server every 30 s are not news; what it does is logged as mint.hooks
    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = HooksConfig.load(None)
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level="warning")


if __name__ == "__main__":
    main()
