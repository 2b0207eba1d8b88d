"""A router revision on disk: it loads to the same decisions, its revision is its contents' digest, and every way a
revision can be broken is refused with an error naming the file; the route log joins rewards and rotates."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mint_core.routing import Featurizer, RouteLog, Router, RouteRecord, RouterLoadError, sparse_features

FEAT = Featurizer(dim=32)
ARMS = ["a", "b", "base"]


def trained(seed: int = 0) -> Router:
    rng = np.random.default_rng(seed)
    router = Router(FEAT, seed=seed)
    router.set_revision("a", "rev-1")
    router.warm_start("b", [FEAT.transform(f"write code {i}") for i in range(5)])
    for i in range(60):
        x = FEAT.transform(f"question {i} about {'sums' if i % 2 else 'code'}")
        router.update(ARMS[i % 3], x, float(rng.random() < 0.5))
    return router


def test_save_load_round_trip_gives_the_same_decisions_and_revision(tmp_path: Path) -> None:
    router = trained()
    rev = router.save(tmp_path / "r")
    loaded = Router.load(tmp_path / "r", featurizer=FEAT)
    assert loaded.revision == rev == router.revision and len(rev) == 64
    assert loaded.arms() == router.arms() and loaded.revisions() == {"a": "rev-1"}
    assert loaded.hyper() == router.hyper()
    for i in range(20):
        x = FEAT.transform(f"prompt {i}")
        assert np.array_equal(loaded.probs(x, ARMS), router.probs(x, ARMS))
    r1, r2 = np.random.default_rng(9), np.random.default_rng(9)
    xs = [FEAT.transform(f"prompt {i}") for i in range(50)]
    assert [router.choose(x, ARMS, rng=r1).arm for x in xs] == [
        loaded.choose(x, ARMS, rng=r2).arm for x in xs
    ]
    # the same state saves to the same revision anywhere; learning changes it; saving over a revision replaces it
    assert trained().save(tmp_path / "again") == rev
    loaded.update("a", xs[0], 1.0)
    assert loaded.save(tmp_path / "r") != rev
    assert Router.load(tmp_path / "r").revision == loaded.revision
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "again",
        "r",
    ]  # no temp or old directory left behind


def _rewrite_arrays(path: Path, **change: np.ndarray) -> None:
    with np.load(path / "state.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays.update(change)
    np.savez(path / "state.npz", **arrays)  # type: ignore[arg-type]


def _edit_manifest(path: Path, **change: object) -> None:
    m = json.loads((path / "manifest.json").read_text())
    m.update(change)
    (path / "manifest.json").write_text(json.dumps(m))


Change = Callable[[Path], object]
CASES: list[tuple[str, Change, str, str]] = [
    ("no directory", lambda p: __import__("shutil").rmtree(p), "", "no such directory"),
    ("no manifest", lambda p: (p / "manifest.json").unlink(), "manifest.json", "missing"),
    (
        "manifest not JSON",
        lambda p: (p / "manifest.json").write_text("{nope"),
        "manifest.json",
        "not readable JSON",
    ),
    ("another format", lambda p: _edit_manifest(p, format="x"), "manifest.json", "format 'x'"),
    ("newer version", lambda p: _edit_manifest(p, format_version=99), "manifest.json", "format version 99"),
    ("arms not a list", lambda p: _edit_manifest(p, arms="a"), "manifest.json", "'arms'"),
    (
        "bad featurizer",
        lambda p: _edit_manifest(p, featurizer={"dim": 32}),
        "manifest.json",
        "featurizer config",
    ),
    ("bad hyper", lambda p: _edit_manifest(p, hyper={"epsilon": 0}), "manifest.json", "epsilon"),
    ("no arrays", lambda p: (p / "state.npz").unlink(), "state.npz", "missing"),
    ("arrays not npz", lambda p: (p / "state.npz").write_bytes(b"junk"), "state.npz", "not a readable .npz"),
    ("array missing", lambda p: _drop_array(p, "P"), "state.npz", "array 'P' is missing"),
    (
        "wrong shape",
        lambda p: _rewrite_arrays(p, g=np.zeros((2, 5))),
        "state.npz",
        "array 'g' has shape (2, 5)",
    ),
    ("NaN", lambda p: _nan(p), "state.npz", "array 'P' holds NaN"),
    ("edited values", lambda p: _scaled(p), "", "do not match revision"),
]


def _drop_array(path: Path, name: str) -> None:
    with np.load(path / "state.npz") as z:
        arrays = {k: z[k] for k in z.files if k != name}
    np.savez(path / "state.npz", **arrays)  # type: ignore[arg-type]


def _nan(path: Path) -> None:
    with np.load(path / "state.npz") as z:
        P = z["P"].copy()
    P[0, 0, 0] = np.nan
    _rewrite_arrays(path, P=P)


def _scaled(path: Path) -> None:
    with np.load(path / "state.npz") as z:
        g = z["g"] * 2
    _rewrite_arrays(path, g=g)


@pytest.mark.parametrize(("case", "change", "file", "message"), CASES, ids=[c[0] for c in CASES])
def test_a_broken_revision_is_refused_naming_the_file(
    tmp_path: Path, case: str, change: Change, file: str, message: str
) -> None:
    path = tmp_path / "r"
    trained().save(path)
    change(path)
    with pytest.raises(RouterLoadError, match="router revision at") as e:
        Router.load(path)
    assert e.value.path == str(path / file if file else path)
    assert message in e.value.problem, e.value.problem


def test_a_featurizer_mismatch_is_refused(tmp_path: Path) -> None:
    trained().save(tmp_path / "r")
    with pytest.raises(RouterLoadError, match="featurizer mismatch") as e:
        Router.load(tmp_path / "r", featurizer=Featurizer(dim=64))
    assert e.value.path == str(tmp_path / "r" / "manifest.json")


def record(rid: str, x: np.ndarray, **kw: object) -> RouteRecord:
    base: dict = dict(
        rid=rid, t=0.0, router_revision="r1", features_digest=FEAT.digest(x),
        features=sparse_features(x), candidates=ARMS, choice="a", prob=0.5, explored=False, revision="sha",
    )  # fmt: skip
    return RouteRecord(**{**base, **kw})


def test_the_log_joins_rewards_to_decisions_and_skips_what_is_broken(tmp_path: Path, caplog) -> None:
    log = RouteLog(tmp_path / "routing" / "log.jsonl")
    x = FEAT.transform("What is 3 plus 4?")
    log.decided(record("r1", x))
    log.decided(record("r2", x, choice="b"))
    log.rewarded("r1", 0.2, "task")
    log.rewarded("r1", 1.0, "feedback")  # the latest reward wins
    log.rewarded("ghost", 1.0, "task")
    with open(log.path, "a") as f:
        f.write('{"kind": "decision", "rid": \n')  # a torn line
        f.write('{"kind": "reward", "rid": "r2", "reward": 7, "source": "task"}\n')  # out of range
    with pytest.raises(ValueError, match=r"outside \[0, 1\]"):
        log.rewarded("r2", 1.5, "task")
    with pytest.raises(ValueError, match="source"):
        log.rewarded("r2", 1.0, "oracle")
    with caplog.at_level(logging.WARNING, logger="mint_core.routing.log"):
        recs = log.records()
    assert [(r.rid, r.reward, r.reward_source) for r in recs] == [("r1", 1.0, "feedback"), ("r2", None, None)]
    assert log.skipped == 3
    assert "skipped 2 malformed line(s) and 1 reward(s) for unknown requests" in caplog.text
    assert np.array_equal(recs[0].vector(FEAT.dim), x)
    with pytest.raises(ValueError, match="dim 32"):
        recs[0].vector(64)


def test_the_log_rotates_by_size_and_reads_every_file_oldest_first(tmp_path: Path) -> None:
    log = RouteLog(tmp_path / "log.jsonl", max_bytes=2000, keep=3)
    x = FEAT.transform("hello")
    line = len(json.dumps({"kind": "decision", **record("r000", x).model_dump()}))
    for i in range(20):
        log.decided(record(f"r{i:03d}", x, t=float(i)))
    files = log.files()
    assert [f.name for f in files] == ["log.jsonl.3", "log.jsonl.2", "log.jsonl.1", "log.jsonl"]
    assert all(f.stat().st_size <= 2000 for f in files)
    rids = [r.rid for r in log.records()]
    per_file = 2000 // (line + 1)
    assert rids == [f"r{i:03d}" for i in range(20 - len(rids), 20)]  # the oldest file(s) dropped, order kept
    assert len(rids) > 3 * per_file and log.skipped == 0


def test_concurrent_appends_from_threads_keep_every_line_whole(tmp_path: Path) -> None:
    log = RouteLog(tmp_path / "log.jsonl")
    x = FEAT.transform("hello")

    def write(k: int) -> None:
        for i in range(50):
            log.decided(record(f"t{k}-{i}", x))
            log.rewarded(f"t{k}-{i}", 0.5, "task")

    threads = [threading.Thread(target=write, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    recs = log.records()
    assert len(recs) == 400 and log.skipped == 0
    assert all(r.reward == 0.5 for r in recs)
