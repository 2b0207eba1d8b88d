"""`model: "auto"`'s parts that need no server (serving/routing.py): the names a request may be routed to, the forms
of `auto:<patterns>`, where a router may be loaded from, swapping routers, and rewards reaching the router from the
canary state's scores. The HTTP behaviour on both backends is tests/integration/test_routing_serving.py."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from mint_core.data.spec import read_rows, registry
from mint_core.routing.log import RouteLog
from mint_core.routing.router import Decision, Router, RouterLoadError, Step
from mint_core.serving.canary import CanaryState
from mint_core.serving.config import ServingConfig
from mint_core.serving.keys import Caller
from mint_core.serving.protocol import APIError
from mint_core.serving.routing import (
    COLD,
    ONLINE_DIR,
    RouterSpec,
    RoutingMetrics,
    RoutingState,
    candidates_for,
    inside,
    patterns_of,
    policy_name,
)
from mint_testkit.waiting import wait_until

BASE = "tiny-dense"
SERVED = {"add": True, "sort": False, "math-a": True, "math-b": False}


@pytest.mark.parametrize(
    ("model", "patterns"),
    [("auto", None), ("auto:add", ["add"]), ("auto:math-*,sort", ["math-*", "sort"])],
)
def test_auto_forms(model: str, patterns: list[str] | None) -> None:
    assert patterns_of(model) == patterns


@pytest.mark.parametrize("model", ["auto:", "auto:add,", "auto:,x", "auto: "])
def test_an_empty_pattern_is_a_400_naming_model(model: str) -> None:
    with pytest.raises(APIError) as e:
        patterns_of(model)
    assert e.value.status == 400 and e.value.param == "model"


@pytest.mark.parametrize(
    ("caller", "patterns", "expected"),
    [
        (
            Caller("all", ("*",)),
            None,
            {"add": True, "sort": False, "math-a": True, "math-b": False, BASE: True},
        ),
        (Caller("anonymous"), ["math-*"], {"math-a": True, "math-b": False}),
        (Caller("one", ("add",)), None, {"add": True}),  # no base: a key of some policies never reaches it
        (Caller("math", ("math-*",)), ["math-b", "add"], {"math-b": False}),
        (Caller("all", ("*",)), [BASE], {BASE: True}),
    ],
)
def test_candidates_are_the_key_s_names_matched_by_the_patterns(
    caller: Caller, patterns: list[str] | None, expected: dict[str, bool]
) -> None:
    assert candidates_for(caller, SERVED, BASE, patterns) == expected


def _refusal(caller: Caller, patterns: list[str] | None) -> APIError:
    with pytest.raises(APIError) as e:
        candidates_for(caller, SERVED, BASE, patterns)
    return e.value


def test_nothing_left_is_a_404_naming_the_pattern_and_nothing_hidden() -> None:
    hidden, absent = (_refusal(Caller("one", ("add",)), [p]) for p in ("sort", "nope"))
    assert hidden.status == absent.status == 404 and hidden.type == "NotFoundError"
    assert "'sort'" in hidden.message and "add" not in hidden.message
    assert hidden.message.replace("sort", "nope") == absent.message  # a hidden name reads as an absent one
    none = _refusal(Caller("x", ("other",)), None)
    assert none.status == 404 and "no policy to route to" in none.message


def test_policy_names_exclude_addresses_and_canaries() -> None:
    assert [n for n in ("add", "add@canary", "add/v3", "sha256:ab", "t/add") if policy_name(n)] == ["add"]


def test_a_router_is_loaded_from_inside_the_routing_dir_only(tmp_path: Path) -> None:
    root = (tmp_path / "routing").resolve()
    assert inside(root, "r1") == root / "r1"
    assert inside(root, str(root / "a" / "b")) == root / "a" / "b"
    for bad in ("../x", str(tmp_path), ".", "/etc"):
        with pytest.raises(APIError) as e:
            inside(root, bad)
        assert e.value.status == 400 and e.value.param == "path", bad


def _state(tmp_path: Path, router_path: Path | None = None, save_s: float = 60) -> RoutingState:
    cfg = ServingConfig(
        adapter_root=tmp_path / "store",
        routing_dir=tmp_path / "routing",
        route_seed=1,
        router_path=router_path,
        route_save_interval_s=save_s,
    )
    return RoutingState.start(cfg, CollectorRegistry())


def _saved(tmp_path: Path, name: str, arm: str) -> tuple[str, Router]:
    router = Router()
    x = router.featurizer.transform("hello")
    for _ in range(5):
        router.update(arm, x, 1.0)
    return router.save(tmp_path / "routing" / name), router


def test_a_swap_checks_first_and_the_same_revision_is_a_no_op(tmp_path: Path) -> None:
    state = _state(tmp_path)
    assert state.revision == COLD
    r1, _ = _saved(tmp_path, "r1", "add")
    broken = tmp_path / "routing" / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text("{}")
    for spec in (
        RouterSpec(path="broken"),
        RouterSpec(path="r1", revision="f" * 64),
        RouterSpec(path="nothing"),
    ):
        with pytest.raises(RouterLoadError):
            state.swap(spec)
        assert state.revision == COLD
    assert state.swap(RouterSpec(path="r1", revision=r1)) and state.revision == r1
    x = state.featurizer.transform("hi")
    state.router.update("sort", x, 1.0)  # learned online since it was loaded
    assert not state.swap(RouterSpec(path="r1")) and not state.swap(RouterSpec(path="r1", revision=r1))
    assert "sort" in state.router.arms()  # the no-op kept it


def test_a_router_named_by_the_config_serves_from_the_start(tmp_path: Path) -> None:
    r1, _ = _saved(tmp_path, "r1", "add")
    assert _state(tmp_path, router_path=Path("r1")).revision == r1
    (tmp_path / "routing" / "r1" / "state.npz").write_bytes(b"torn")
    with pytest.raises(RouterLoadError, match=r"state\.npz"):
        _state(tmp_path, router_path=Path("r1"))


def test_scores_reach_the_router_and_the_log_once(tmp_path: Path) -> None:
    state = _state(tmp_path)
    canary = CanaryState()
    canary.on_score.append(state.scored)
    x = state.featurizer.transform("write a poem")
    decision = state.decide(x, {"add": True, "sort": True})
    state.answered("cmpl-1", x, decision, ["add", "sort"], decision.arm, "sha256:aa")
    canary.answered("cmpl-1", decision.arm, "none", decision.arm, "sha256:aa", None)
    canary.answered(
        "cmpl-2", "other", "none", "other", "sha256:bb", None
    )  # not routed: the router ignores it
    before = state.router.predict(x, [decision.arm])[0]
    canary.feedback("cmpl-1", 1.0)
    canary.feedback("cmpl-2", 1.0)
    state.settle()  # the learner thread has updated the router and written the log
    assert state.router.predict(x, [decision.arm])[0] > before + 0.1
    (record,) = RouteLog(tmp_path / "routing" / "log.jsonl").records()
    assert (record.rid, record.choice, record.reward, record.reward_source) == (
        "cmpl-1",
        decision.arm,
        1.0,
        "feedback",
    )
    assert (
        record.router_revision == ""
        and record.revision == "sha256:aa"
        and record.candidates == ["add", "sort"]
    )
    assert np.allclose(record.vector(state.featurizer.dim), x, atol=1e-6)


def test_the_learner_keeps_going_after_a_failed_log_write(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Log writes and updates run in the learner thread: one that fails is logged, and the next ones still run,
    each decision before its reward."""
    state = _state(tmp_path)
    canary = CanaryState()
    canary.on_score.append(state.scored)
    x = state.featurizer.transform("write a poem")
    decision = state.decide(x, {"add": True})
    good = state.log.path
    state.log.path = tmp_path / "routing"  # a directory: the append fails
    state.answered("cmpl-1", x, decision, ["add"], decision.arm, "sha256:aa")
    state.settle()
    assert "routing: _record failed" in caplog.text
    state.log.path = good
    for rid in ("cmpl-2", "cmpl-3"):
        state.answered(rid, x, decision, ["add"], decision.arm, "sha256:aa")
        canary.answered(rid, decision.arm, "none", decision.arm, "sha256:aa", None)
        canary.feedback(rid, 1.0)
    state.settle()
    records = RouteLog(good).records()
    assert [(r.rid, r.reward) for r in records] == [("cmpl-2", 1.0), ("cmpl-3", 1.0)]


class _Held(Router):
    """A router whose update, once begun (`begun`), waits for `release` before its arithmetic: a refresh in
    progress (refresh 1: every update recomputes the inverse)."""

    def __init__(self) -> None:
        super().__init__(refresh=1)
        self.begun, self.release = threading.Event(), threading.Event()

    def update_step(self, arm: str, x: np.ndarray, reward: float) -> Step:
        self.begun.set()
        self.release.wait(60)
        return super().update_step(arm, x, reward)


def _learn(
    state: RoutingState, canary: CanaryState, rid: str, x: np.ndarray, arm: str, reward: float
) -> None:
    """One routed answer by `arm` and its reward, handed to the learner."""
    decision = state.decide(x, {arm: True})
    state.answered(rid, x, decision, [arm], arm, "sha256:aa")
    canary.answered(rid, arm, "none", arm, "sha256:aa", None)
    canary.feedback(rid, reward)


def test_a_decision_does_not_wait_for_a_refresh_in_progress(tmp_path: Path) -> None:
    router = _Held()
    root = tmp_path / "routing"
    metrics, rng = RoutingMetrics(CollectorRegistry()), np.random.default_rng(0)
    state = RoutingState(router, None, root, RouteLog(root / "log.jsonl"), metrics, 0.05, rng)
    canary = CanaryState()
    canary.on_score.append(state.scored)
    x = router.featurizer.transform("write a poem")
    try:
        _learn(state, canary, "cmpl-1", x, "add", 1.0)
        assert router.begun.wait(30), "the learner never began the update"
        decided = threading.Event()

        def decide() -> None:
            state.decide(x, {"add": True})
            decided.set()

        threading.Thread(target=decide, daemon=True).start()
        assert decided.wait(30), "a decision waited for the update in progress"
        assert state.router.predict(x, ["add"])[0] == 0.0  # it decided on the router before the update
    finally:
        router.release.set()
    state.settle()
    assert state.router.predict(x, ["add"])[0] > 0.1


def test_a_restarted_server_serves_the_router_it_learned(tmp_path: Path) -> None:
    r1, _ = _saved(tmp_path, "r1", "sort")
    state = _state(tmp_path, save_s=3600)  # saved by close only, as at a shutdown
    assert state.swap(RouterSpec(path="r1", revision=r1))  # as a reconcile puts the champion
    canary = CanaryState()
    canary.on_score.append(state.scored)
    x = state.featurizer.transform("write a poem")
    for i in range(5):
        _learn(state, canary, f"cmpl-{i}", x, "add", 1.0)
    state.close()
    again = _state(tmp_path)
    online = (tmp_path / "routing" / ONLINE_DIR).resolve()
    assert again.path == online and again.router.arms() == state.router.arms() == ["sort", "add"]
    assert np.array_equal(again.router.probs(x, ["add", "sort"]), state.router.probs(x, ["add", "sort"]))
    # known by the revision it served as, so the champion put again is a no-op that keeps what was learned
    assert again.revision == state.revision == r1 and not again.swap(RouterSpec(path="r1", revision=r1))
    named = _state(tmp_path, router_path=Path("r1"))  # the save goes on from the revision the config names
    assert (named.revision, named.path, named.router.arms()) == (r1, online, ["sort", "add"])
    (tmp_path / "routing" / "online.json").unlink()  # the save alone: it serves as its own revision
    assert _state(tmp_path).revision == Router.load(online).revision != r1
    assert _state(tmp_path, save_s=0).revision == COLD  # not saving: nothing loaded from there either
    named = _state(tmp_path, router_path=Path("r1"))  # a save of another revision: the config's router serves
    assert (named.revision, named.router.arms()) == (r1, ["sort"])


def _online_revision(root: Path) -> str | None:
    try:
        return str(json.loads((root / ONLINE_DIR / "manifest.json").read_text())["revision"])
    except (OSError, ValueError):  # not saved yet, or between the two renames of a save
        return None


def test_the_serving_router_is_saved_as_it_learns(tmp_path: Path) -> None:
    state = _state(tmp_path, save_s=0.05)
    root = (tmp_path / "routing").resolve()
    canary = CanaryState()
    canary.on_score.append(state.scored)
    x = state.featurizer.transform("write a poem")
    _learn(state, canary, "cmpl-1", x, "add", 1.0)
    first = wait_until(lambda: _online_revision(root), 30, "the first save")
    _learn(state, canary, "cmpl-2", x, "add", 0.0)
    wait_until(lambda: _online_revision(root) not in (None, first), 30, "a save of what was learned next")
    state.close()
    assert Router.load(root / ONLINE_DIR).predict(x, ["add"]) == state.router.predict(x, ["add"])


def test_a_corrupt_saved_router_is_refused_and_the_server_starts_cold(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _saved(tmp_path, ONLINE_DIR, "add")
    (tmp_path / "routing" / ONLINE_DIR / "state.npz").write_bytes(b"torn")
    with caplog.at_level(logging.ERROR, logger="mint_core.serving.routing"):
        state = _state(tmp_path)
    assert state.revision == COLD and state.path is None
    assert "refused, starting cold" in caplog.text and "state.npz" in caplog.text, caplog.text
    canary = CanaryState()
    canary.on_score.append(state.scored)
    _learn(state, canary, "cmpl-1", state.featurizer.transform("hi"), "sort", 1.0)
    state.settle()
    saved = state.save()  # the next save replaces it
    assert saved is not None and Router.load(tmp_path / "routing" / ONLINE_DIR).revision == saved


def _taught(
    state: RoutingState, canary: CanaryState, x: np.ndarray, revision: str, reward: float, n: int
) -> None:
    """`n` routed answers of the add arm at `revision`, each scored `reward` (feedback), learned."""
    for k in range(n):
        rid = f"cmpl-{revision}-{k}"
        state.answered(rid, x, Decision("add", 1.0, False, 0.0), ["add", "sort"], "add", revision)
        canary.answered(rid, "add", "none", "add", revision, None)
        canary.feedback(rid, reward)
    state.settle()


@pytest.mark.parametrize("cold_start", [True, False])
def test_a_new_revision_starts_from_its_task_s_cold_start(tmp_path: Path, cold_start: bool) -> None:
    """The add arm starts warm from add's held-out prompts; its revision then answers them badly and loses them. An
    answer at a new revision tells the router the policy changed: the arm starts from its task's cold start again,
    before a single reward of the new revision, where an arm with no cold start only forgets."""
    state = _state(tmp_path)
    canary = CanaryState()
    canary.on_score.append(state.scored)
    if cold_start:
        asyncio.run(state.warm(["add", "sort"]))
    x = state.featurizer.transform(read_rows(registry().get("add"), "heldout")[0].prompt)
    warm = state.router.predict(x, ["add"])[0]
    _taught(state, canary, x, "sha256:aa", 0.0, 40)
    bad = state.router.predict(x, ["add"])[0]
    assert bad < 0.1 and (bad < warm - 0.5 if cold_start else warm == 0.0)
    # an answer at the new revision, not scored yet: only the revision is news
    state.answered("cmpl-new", x, Decision("add", 1.0, False, 0.0), ["add", "sort"], "add", "sha256:bb")
    state.settle()
    new = state.router.predict(x, ["add"])[0]
    assert state.router.revisions()["add"] == "sha256:bb"
    if cold_start:
        assert new > bad + 0.2, (warm, bad, new)
    else:
        assert abs(new) < abs(bad) + 1e-9 and new < 0.1, (bad, new)
