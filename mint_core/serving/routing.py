"""`model: "auto"`: the server picks the adapter, on both backends (mint serve and the vLLM front).

A request naming `model: "auto"` is answered by one of the served names its key may call: every catalog champion and
every policy name the server holds, plus the base (only for a key of every policy, as for a named request).
`model: "auto:<pattern>[,<pattern>...]"` narrows that set to the names the patterns match (the glob of serving keys,
`mint_core.access.allows`: `auto:math-*`, `auto:add,sort`). The form is a model name, so it works in every OpenAI
client with no extra body field, and a caller who knows the group a prompt belongs to says so without naming a
revision. What answers is named as for any request (the response's `model`, its `system_fingerprint`), and two
headers say it was routed: `X-Mint-Routed: <served name>`, `X-Mint-Router: <router revision>`.

The router (`mint_core.routing.Router`) sees the prompt's features alone: the server's task lookup scores an answer
after it is given (serving/canary.py) and never decides the route, because real traffic is not in the registry.
Each routed answer is remembered by its response id; the canary state's scores (the task's own reward, or
`POST /v1/feedback`) reach `RoutingState.scored`, which updates the router and appends the reward to the route log
(`<routing dir>/log.jsonl`: features, candidates, choice, probability, router revision; what the `route` flow fits
and evaluates the next router from).

`RoutingMiddleware` sits outside `CanaryMiddleware`, so the split, the key checks and the scoring see the concrete
name. A request it cannot route is answered here in OpenAI's error shape: 404 when nothing servable is left for
the key (naming the patterns asked, never the names hidden from the key), 400 for `auto:` with an empty pattern.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mint_core.access import allows
from mint_core.data.spec import SpecError, TaskRegistry, read_rows, registry
from mint_core.routing.features import Featurizer
from mint_core.routing.log import RouteLog, RouteRecord, sparse_features
from mint_core.routing.router import Claim, Decision, Router, RouterLoadError, Step
from mint_core.serving.admin import Auth
from mint_core.serving.canary import (
    AUTO,
    ROUTED_STATE,
    ROUTES,
    Collected,
    ScoreEvent,
    prompt_of,
    read_body,
    replay,
)
from mint_core.serving.config import ServingConfig
from mint_core.serving.keys import Caller
from mint_core.serving.protocol import APIError

logger = logging.getLogger(__name__)

ROUTED_HEADER = "x-mint-routed"
ROUTER_HEADER = "x-mint-router"
COLD = "cold"
"""The revision a router started cold has until one is loaded: it names no saved state."""
LOG_FILE = "log.jsonl"
ONLINE_DIR = "online"
"""Where in the routing dir the serving router is saved as it learns (`route_save_interval_s`), and loaded from
at start when no `router_path` is set."""
ONLINE_NAME = "online.json"
"""Beside ONLINE_DIR: the revision the serving router was known by when it was saved (the one it was loaded or put
as; `""` for one started cold), and the save's own revision it applies to."""
MAX_ROUTED = 100_000
"""Routed answers remembered for their reward (oldest forgotten first), features kept as float16 (~0.5 KB each)."""
WARM_POSITIVES = 64
"""Held-out prompts of an arm's own task added to its prior as reward-1 pseudo-observations (cold start)."""
WARM_NEGATIVES = 16
"""Held-out prompts of each other registered task added to an arm's prior as reward-0 pseudo-observations."""
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)

Served = Callable[[Scope], Awaitable[Mapping[str, bool]]]
"""What a backend can serve now, by policy name (the base left out), each with whether it is resident (held by
the server: no cold load before it answers)."""


class RouterSpec(BaseModel):
    """`PUT /v1/mint/router`: serve the router revision saved at `path`."""

    path: str = Field(min_length=1)
    """The router's directory, inside the server's routing dir (relative to it, or absolute)."""
    revision: str | None = None
    """When given, the revision the directory must hold (else 422): what the registry's alias names."""


class RouterView(BaseModel):
    """`GET /v1/mint/router`: which router revision routes `model: "auto"` here."""

    revision: str
    """The loaded revision's content digest, or `cold` for a router started with no saved state."""
    path: str | None
    """Where it was loaded from (None: started cold)."""
    loaded_at: float
    arms: list[str]
    """The served names it has met that the caller may call."""
    routed: int
    """Requests routed since it was loaded."""
    explored: int
    """Of those, how many were exploration (not the greedy choice)."""
    log: str
    """The route log the decisions and rewards are appended to."""


@dataclass
class _Routed:
    arm: str
    x: np.ndarray  # float16: what the reward updates the router with


class RoutingMetrics:
    """The routing series, registered in the backend's registry (the same names on both backends)."""

    def __init__(self, registry: CollectorRegistry):
        self.routed = Counter(
            "mint_routed_requests",
            "Requests for model auto, by the served name chosen",
            ["arm"],
            registry=registry,
        )
        self.explored = Counter(
            "mint_routed_explored",
            "Routed requests that explored (not the router's greedy choice)",
            registry=registry,
        )
        self.decide = Histogram(
            "mint_route_decision_seconds",
            "Time to route one request: features and the router's choice",
            buckets=DECISION_BUCKETS,
            registry=registry,
        )
        self.revision = Gauge(
            "mint_router_revision",
            "The router revision serving (1 on its label)",
            ["revision"],
            registry=registry,
        )

    def serving(self, revision: str, previous: str | None) -> None:
        if previous is not None and previous != revision:
            with contextlib.suppress(KeyError):
                self.revision.remove(previous)
        self.revision.labels(revision).set(1)


class RoutingState:
    """The serving router of one server, its route log and the routed answers awaiting a reward. The router is
    read and changed under one lock (decisions on the event loop; learning, warm starts and loads in worker
    threads), but a change's arithmetic is computed outside it (`_change`): the lock is held for microseconds.

    What follows an answer is off the event loop: an answer's log line (its features' digest and sparse form, the
    record's JSON, the file append) and a reward's router update (O(d^2), and every `REFRESH` updates of an arm an
    O(d^3) inverse: milliseconds) run in one learner thread, in the order they were asked for, so the log keeps each
    decision before its reward and the router learns the rewards in the order they came. What must be known at once
    stays on the loop: which answers await a reward (so each is scored once) and the revision that decided. A
    decision taken while a reward is being learned sees the router before it (`settle` waits for the learner).

    With `route_save_interval_s` > 0 a saver thread saves the router to `<routing dir>/online` as it changes
    (`save`), and `close` (at the server's shutdown) makes a last save; a server started again serves it."""

    def __init__(
        self,
        router: Router,
        path: Path | None,
        root: Path,
        log: RouteLog,
        metrics: RoutingMetrics,
        cold_load_cost: float,
        rng: np.random.Generator,
        tasks: Callable[[], TaskRegistry] = registry,
    ):
        self.router, self.path, self.root, self.log = router, path, root, log
        self.metrics, self.cold_load_cost, self.rng, self.tasks = metrics, cold_load_cost, rng, tasks
        self.loaded_at = time.time()
        self.routed_count = self.explored_count = 0
        self._lock = threading.Lock()
        self._writing = threading.Lock()  # one writer of the router at a time, its arithmetic outside _lock
        self._changes = 0  # changes applied to the serving router (what a save would have to write)
        self._routed: OrderedDict[str, _Routed] = OrderedDict()
        self._warm: set[str] = set()  # arms this router was offered a cold start for (done or nothing to do)
        # each task-named arm's cold start, added again on a new revision, with the router it was computed for
        self._claims: dict[str, tuple[Router, list[Claim]]] = {}
        self._warming = asyncio.Lock()
        self._learner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mint-route-learner")
        self._saving = threading.Lock()  # one save at a time (the saver thread, close)
        self._saved = 0  # the value of _changes the last save wrote
        self._stop = threading.Event()
        self._saver: threading.Thread | None = None
        metrics.serving(self.revision, None)

    @classmethod
    def start(cls, config: ServingConfig, registry_: CollectorRegistry) -> RoutingState:
        """The router of a starting server (`_starting`): the one saved in `<routing dir>/online` as it learned
        before (with `route_save_interval_s` > 0; one that does not load is logged and refused; with `router_path`
        set, only one that went on from that revision), else `config.router_path` (RouterLoadError when it does not
        load: a wrong setting stops the start), else a cold one. With `route_save_interval_s` > 0 it is saved there
        every that many seconds while it changes."""
        root = config.routing_root().resolve()
        root.mkdir(parents=True, exist_ok=True)
        saving = config.route_save_interval_s > 0
        router, path = _starting(root, config.router_path, saving)
        log = RouteLog(root / LOG_FILE)
        rng = np.random.default_rng(config.route_seed)
        state = cls(router, path, root, log, RoutingMetrics(registry_), config.route_cold_load_cost, rng)
        if saving:
            state._saver = threading.Thread(
                target=state._save_every,
                args=(config.route_save_interval_s,),
                name="mint-route-saver",
                daemon=True,
            )
            state._saver.start()
        logger.info(
            "routing model auto with router %s from %s (log %s)",
            state.revision,
            path or "nothing",
            root / LOG_FILE,
        )
        return state

    @property
    def revision(self) -> str:
        return self.router.revision or COLD

    @property
    def featurizer(self) -> Featurizer:
        return self.router.featurizer

    # -- deciding and learning --------------------------------------------------------------------------------

    def decide(self, x: np.ndarray, candidates: Mapping[str, bool]) -> Decision:
        """The router's choice among `candidates` (name -> resident): a cold load costs `cold_load_cost`."""
        costs = {n: self.cold_load_cost for n, resident in candidates.items() if not resident}
        with self._lock:
            decision = self.router.choose(x, list(candidates), rng=self.rng, costs=costs)
            self.routed_count += 1
            self.explored_count += decision.explored
        self.metrics.routed.labels(decision.arm).inc()
        if decision.explored:
            self.metrics.explored.inc()
        return decision

    def answered(
        self, rid: str, x: np.ndarray, decision: Decision, candidates: list[str], model: str, revision: str
    ) -> None:
        """A routed request was answered (`model` the served name that answered, at `revision`): remembered for
        its reward, logged, and the arm told its policy's revision (a change shrinks the old evidence)."""
        t = time.time()
        with self._lock:
            self._routed[rid] = _Routed(decision.arm, x.astype(np.float16))
            if len(self._routed) > MAX_ROUTED:
                self._routed.popitem(last=False)
            router = self.router
        self._learn(self._record, router, rid, t, x, decision, candidates, model, revision)

    def _record(
        self,
        router: Router,
        rid: str,
        t: float,
        x: np.ndarray,
        decision: Decision,
        candidates: list[str],
        model: str,
        revision: str,
    ) -> None:
        """The learner's part of `answered`: the arm told its revision, the decision logged."""
        if model == decision.arm and revision:  # a canary's answers are not the policy's revision
            owner, claims = self._claims.get(decision.arm, (None, []))
            claims = claims if owner is router else []  # computed for another router's featurizer: none
            self._change(router, router.revision_step, decision.arm, revision, claims)
        router_revision = router.revision  # "" for a cold router: no saved state to replay
        self.log.decided(
            RouteRecord(
                rid=rid,
                t=t,
                router_revision=router_revision,
                features_digest=router.featurizer.digest(x),
                features=sparse_features(x),
                candidates=candidates,
                choice=decision.arm,
                prob=decision.prob,
                explored=decision.explored,
                revision=revision,
                reward=None,
                reward_source=None,
            )
        )

    def scored(self, rid: str, event: ScoreEvent) -> None:
        """`CanaryState.on_score`: the reward of an answer (the task's, or feedback); a routed one updates the
        router and the log. Each answer is scored once (the canary state refuses a second score)."""
        with self._lock:
            routed = self._routed.pop(rid, None)
            router = self.router
        if routed is not None:
            self._learn(self._reward, router, rid, routed, event)

    def _reward(self, router: Router, rid: str, routed: _Routed, event: ScoreEvent) -> None:
        """The learner's part of `scored`: the router that decided learns the reward, the log keeps it."""
        self._change(router, router.update_step, routed.arm, routed.x.astype(np.float32), event.score)
        self.log.rewarded(rid, event.score, event.source)

    def _change(self, router: Router, step: Callable[..., Step], *args: Any) -> None:
        """Compute a change of `router` (one writer at a time: the learner, a cold start) outside the lock the
        decisions take, then apply it under that lock: a decision never waits for the arithmetic (a refresh's
        O(d^3) inverse), only for the O(d) swap. The decisions meanwhile see the router before the change."""
        with self._writing:
            change = step(*args)
            with self._lock:
                router.apply(change)
                self._changes += router is self.router

    def _learn(self, job: Callable[..., None], *args: Any) -> None:
        """Run `job(*args)` in the learner thread, after every job asked for before it."""

        def run() -> None:
            try:
                job(*args)
            except Exception:  # a failed log write or update must not stop the next ones
                logger.exception("routing: %s failed", job.__name__)

        self._learner.submit(run)

    def settle(self) -> None:
        """Wait until every answer and reward handed to the learner so far is learned and logged."""
        self._learner.submit(lambda: None).result()

    # -- saved as it learns ------------------------------------------------------------------------------------

    def _save_every(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.save()
            except Exception:  # a full disk must not stop the next tries, nor the serving
                logger.exception("routing: saving the router to %s failed", self.root / ONLINE_DIR)

    def save(self) -> str | None:
        """Save the serving router to `<routing dir>/online` (atomically: a restart finds the last whole save) when
        it changed since the last save; its revision, or None when there was nothing new. The state is taken under
        the lock in O(arms) (`Router.snapshot`); the files are written outside it, while decisions and learning go
        on. The serving router keeps the revision it was loaded with (what `X-Mint-Router`, the route log and a
        reconcile know it by), and a restart that loads the save names it so again (ONLINE_NAME)."""
        with self._saving:
            with self._lock:
                if self._changes == self._saved:
                    return None
                changes, snap, name = self._changes, self.router.snapshot(), self.router.revision
            revision = snap.save(self.root / ONLINE_DIR)
            tmp = self.root / f".{ONLINE_NAME}.tmp"
            tmp.write_text(json.dumps({"saved": revision, "serving": name}))
            tmp.replace(self.root / ONLINE_NAME)
            self._saved = changes
        logger.debug("routing: the serving router is saved as %s in %s", revision, self.root / ONLINE_DIR)
        return revision

    def close(self) -> None:
        """At shutdown: the saver stops, what the learner was given is learned, and a last save is made (when
        saving is on)."""
        self._stop.set()
        saver = self._saver
        if saver is not None:
            saver.join()
        self.settle()
        if saver is not None:
            self.save()

    # -- cold start -------------------------------------------------------------------------------------------

    async def warm(self, names: list[str]) -> None:
        """Give every arm met for the first time that names a registered task its cold start (in a worker thread:
        it reads the task's held-out rows once); an arm the router already knows keeps what it learned."""
        if all(n in self._warm for n in names):
            return
        async with self._warming:
            new = [n for n in names if n not in self._warm]
            if new:
                await asyncio.to_thread(self._warm_start, new)

    def _warm_start(self, names: list[str]) -> None:
        router = self.router
        try:
            tasks = self.tasks()
        except SpecError as e:
            logger.warning("no cold start for the router's arms: the task registry does not load: %s", e)
            self._warm.update(names)
            return
        known = set(router.arms())
        seen: dict[str, np.ndarray] = {}  # each task's first held-out prompts featurized once for all arms

        def heldout(task: str, limit: int) -> np.ndarray:
            if task not in seen:
                seen[task] = router.featurizer.transform_many(_heldout(tasks, task, WARM_POSITIVES))
            return seen[task][:limit]

        for arm in names:
            if arm in tasks:
                positives = heldout(arm, WARM_POSITIVES)
                negatives = [heldout(t, WARM_NEGATIVES) for t in tasks.names() if t != arm]
                claims: list[Claim] = [
                    (xs, reward)
                    for xs, reward in ((positives, 1.0), (np.concatenate([positives[:0], *negatives]), 0.0))
                    if len(xs)
                ]
                if router is not self.router:  # swapped meanwhile: the new router is offered its own
                    return
                # a new revision of the arm's policy starts from them again (the router's own arms too)
                self._claims[arm] = (router, claims)
                if arm not in known:
                    for xs, reward in claims:
                        self._change(router, router.warm_step, arm, xs, reward)
                    logger.info(
                        "router arm %s: cold start from %d held-out prompts of its task", arm, len(positives)
                    )
            self._warm.add(arm)

    # -- which router serves ----------------------------------------------------------------------------------

    def swap(self, spec: RouterSpec) -> bool:
        """Serve the router saved at `spec.path` (run in a worker thread: it reads and checks the files). Nothing
        changes unless it loads and holds `spec.revision` when one is given; the same revision again is a no-op
        that keeps what the serving one learned online. True when the router changed."""
        path = inside(self.root, spec.path)
        if spec.revision is not None and spec.revision == self.router.revision:
            return False
        loaded = Router.load(path)  # RouterLoadError names the file and the problem
        if spec.revision is not None and loaded.revision != spec.revision:
            raise RouterLoadError(path, f"it holds revision {loaded.revision}, not {spec.revision}")
        with self._lock:
            if loaded.revision == self.router.revision:
                return False
            previous = self.revision
            self.router, self.path, self.loaded_at = loaded, path, time.time()
            self.routed_count = self.explored_count = 0
            self._warm, self._claims = set(), {}
            self._changes += 1  # what a restart should serve now
        self.metrics.serving(self.revision, previous)
        logger.info("router %s serves model auto (was %s), from %s", self.revision, previous, path)
        return True

    def view(self, caller: Caller, base_name: str) -> RouterView:
        with self._lock:
            return RouterView(
                revision=self.revision,
                path=None if self.path is None else str(self.path),
                loaded_at=self.loaded_at,
                arms=caller.visible(self.router.arms(), base_name),
                routed=self.routed_count,
                explored=self.explored_count,
                log=str(self.log.path),
            )


def _starting(root: Path, router_path: Path | None, saving: bool) -> tuple[Router, Path | None]:
    """The router a server starts with, and where it was loaded from: `router_path`'s (RouterLoadError when it
    does not load: a wrong setting stops the start), unless the save in ONLINE_DIR goes on from that revision;
    without `router_path`, the save; else a cold router."""
    path = None if router_path is None else inside(root, str(router_path))
    named = None if path is None else Router.load(path)
    if saving and (root / ONLINE_DIR).exists():
        online = _online(root / ONLINE_DIR, None if named is None else named.revision)
        if online is not None:
            return online, root / ONLINE_DIR
    return (Router(), None) if named is None else (named, path)


def _online(path: Path, revision: str | None) -> Router | None:
    """The router saved as it learned (`RoutingState.save`), known by the revision it served as; None when it does
    not load (said in the log: a torn or edited save must not keep the server from starting, and the next save
    replaces it) or when `router_path` names another `revision` than the one it went on from."""
    instead = "cold" if revision is None else "from router_path"
    try:
        router = Router.load(path)
    except RouterLoadError as e:
        logger.error(
            "routing: the router saved online is refused, starting %s (the next save replaces it): %s",
            instead,
            e,
        )
        return None
    try:
        named = json.loads((path.parent / ONLINE_NAME).read_text())
    except (OSError, ValueError):
        named = None
    if (
        isinstance(named, dict)
        and named.get("saved") == router.revision
        and isinstance(named.get("serving"), str)
    ):
        router.revision = named["serving"]
    else:
        logger.warning(
            "routing: %s does not name the save in %s: it serves as its own revision", ONLINE_NAME, path
        )
    if revision is not None and router.revision != revision:
        logger.info(
            "routing: the router saved online went on from %s, not router_path's %s",
            router.revision,
            revision,
        )
        return None
    return router


def _heldout(tasks: TaskRegistry, task: str, limit: int) -> list[str | list[dict[str, str]]]:
    try:
        return [r.prompt for r in read_rows(tasks.get(task), "heldout")[:limit]]
    except SpecError as e:
        logger.info("task %s: no held-out prompts for the router's cold start: %s", task, e)
        return []


def inside(root: Path, path: str) -> Path:
    """A router directory named by a load: inside the routing dir (relative to it, or absolute), never elsewhere:
    an admin token must not turn into reading arbitrary files. 400 otherwise."""
    p = Path(path)
    real = (p if p.is_absolute() else root / p).resolve()
    if real == root or root not in real.parents:
        raise APIError(
            400, f"router path {path!r} is not inside the routing dir {root}", "BadRequestError", "path"
        )
    return real


def patterns_of(model: str) -> list[str] | None:
    """The patterns of `auto:<p>[,<p>...]` (None for plain `auto`); 400 for an empty one."""
    if model == AUTO:
        return None
    patterns = model[len(AUTO) + 1 :].split(",")
    if not all(p.strip() for p in patterns):
        raise APIError(
            400, f"{model!r}: `auto:` needs one or more patterns, comma-separated", "BadRequestError", "model"
        )
    return [p.strip() for p in patterns]


def is_auto(model: object) -> bool:
    return isinstance(model, str) and (model == AUTO or model.startswith(AUTO + ":"))


def candidates_for(
    caller: Caller, served: Mapping[str, bool], base_name: str, patterns: list[str] | None
) -> dict[str, bool]:
    """The names a routed request may be answered by (name -> resident): those the key may call, matched by the
    patterns when given, the base (resident) among them. 404 when none is left: naming the patterns, not what the
    key may not see."""
    names = {n: r for n, r in served.items() if caller.may(n, base_name)}
    if caller.may(base_name, base_name):
        names[base_name] = True
    if patterns is not None:
        names = {n: r for n, r in names.items() if allows(patterns, n)}
    if not names:
        if patterns is None:
            raise APIError(
                404, "no policy to route to: this key may call no served model", "NotFoundError", "model"
            )
        raise APIError(
            404,
            f"no policy to route to: no served model this key may call matches {','.join(patterns)!r}",
            "NotFoundError",
            "model",
        )
    return names


def policy_name(name: str) -> bool:
    """Whether a held name is a policy's own (routable), not a catalog address or a canary (`p@alias`, `p/v3`,
    `sha256:...`) held under that address."""
    return bool(name) and "@" not in name and "/" not in name and not name.startswith("sha256:")


class RoutingMiddleware:
    """ASGI middleware (outside `CanaryMiddleware`) that answers `model: "auto"` on the completion routes: picks a
    served name with the router, rewrites the request's model, names the choice in the answer's headers and
    remembers the answer for its reward. Other requests pass through untouched."""

    def __init__(
        self,
        app: ASGIApp,
        state: RoutingState,
        auth: Auth,
        base_name: str,
        served: Served,
        refused: Callable[[str, object, int], None],
    ):
        self.app, self.state, self.auth, self.base_name = app, state, auth, base_name
        self.served, self.refused = served, refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._closing(send))
            return
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ROUTES:
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:
            return
        try:  # most requests name their model: their body is parsed by the canary and the route, not here
            data = json.loads(bytes(body)) if b'"auto' in body else None
        except ValueError:
            data = None
        if not isinstance(data, dict) or not is_auto(data.get("model")):
            await self.app(scope, replay(bytes(body), receive), send)
            return
        try:
            caller = self.auth.identify(Request(scope))
        except APIError:  # no or a wrong key: the route answers it, as for any model
            await self.app(scope, replay(bytes(body), receive), send)
            return
        try:
            candidates = candidates_for(
                caller, await self.served(scope), self.base_name, patterns_of(data["model"])
            )
            await self.state.warm(list(candidates))
            t0 = time.perf_counter()
            prompt = prompt_of(scope["path"], data)
            x = self.state.featurizer.transform(prompt if prompt is not None else "")
            decision = self.state.decide(x, candidates)
            self.state.metrics.decide.observe(time.perf_counter() - t0)
        except APIError as e:
            self.refused(scope["path"], data.get("model"), e.status)
            await JSONResponse(e.response().model_dump(), status_code=e.status)(scope, receive, send)
            return
        await self._forward(scope, receive, send, data, x, decision, list(candidates))

    def _closing(self, send: Send) -> Send:
        """The lifespan's `send`: once the app has shut down (its queued answers given, so their rewards may be
        handed on), the routing state closes (its last save) before the server is told the shutdown is done."""

        async def send_on(message: Message) -> None:
            if message["type"] in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                await asyncio.to_thread(self.state.close)
            await send(message)

        return send_on

    async def _forward(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        data: dict[str, Any],
        x: np.ndarray,
        decision: Decision,
        candidates: list[str],
    ) -> None:
        """The request under the chosen name, its answer with the routing headers; the answer remembered."""
        data["model"] = decision.arm
        body = json.dumps(data).encode()
        scope = dict(scope)
        scope["headers"] = [
            (k, str(len(body)).encode() if k == b"content-length" else v) for k, v in scope["headers"]
        ]
        scope.setdefault("state", {})[ROUTED_STATE] = decision.arm
        revision = self.state.revision
        collected = Collected(bool(data.get("stream")))
        status = 0

        async def send_on(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = dict(message)
                message["headers"] = [
                    *message.get("headers", []),
                    (ROUTED_HEADER.encode(), decision.arm.encode()),
                    (ROUTER_HEADER.encode(), revision.encode()),
                ]
            elif message["type"] == "http.response.body" and status == 200:
                collected.feed(message.get("body", b""))
            await send(message)

        await self.app(scope, replay(body, receive), send_on)
        if status != 200:
            return
        collected.finish()
        if collected.id is not None:  # remembered before anything can score it (no await since the answer)
            model, fingerprint = collected.model or decision.arm, collected.fingerprint or ""
            self.state.answered(collected.id, x, decision, candidates, model, fingerprint)
