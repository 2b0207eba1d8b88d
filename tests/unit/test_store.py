"""The adapter store: content addressing, immutability, crash safety, verification on read, gc, errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mint_core.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, digest_dir, random_adapter, save_adapter
from mint_core.registry.store import (
    COMMITTED,
    AdapterStore,
    DigestMismatch,
    StoreUnavailable,
    UnknownRevision,
)
from tests.conftest import TARGETS

REPO = Path(__file__).resolve().parents[2]
MISSING = "ab" * 32


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[AdapterStore]:
    if request.param == "local":
        yield AdapterStore(tmp_path / "store")
        return
    s = AdapterStore(f"memory://mint-test-{uuid.uuid4().hex}/store", cache_dir=tmp_path / "cache")
    yield s
    if s.fs.exists(s.root):
        s.fs.rm(s.root, recursive=True)


@pytest.fixture
def sites(make_engine):  # type: ignore[no-untyped-def]
    return make_engine("dense").sites


@pytest.fixture
def make_src(tmp_path: Path, sites) -> Callable[[int], Path]:  # type: ignore[no-untyped-def]
    """make_src(seed): a directory holding one saved adapter revision."""

    def make(seed: int = 0) -> Path:
        d = tmp_path / "src" / f"seed{seed}"
        save_adapter(random_adapter(sites, TARGETS["dense"], rank=4, seed=seed), d, sites)
        return d

    return make


def _files(d: Path) -> tuple[bytes, bytes]:
    return (d / CONFIG_FILE).read_bytes(), (d / WEIGHTS_FILE).read_bytes()


def _tmp_entries(store: AdapterStore) -> list[str]:
    return store._ls_names(f"{store.root}/tmp")


def test_round_trip(store: AdapterStore, make_src: Callable[[int], Path]) -> None:
    src = make_src(0)
    digest = store.put_dir(src)
    assert digest == digest_dir(src)
    assert store.exists(digest) and store.exists(f"sha256:{digest}")
    assert store.list() == [digest]
    assert store.read(digest) == _files(src)
    location = store.path(digest)
    assert location.endswith(f"/sha256/{digest[:2]}/{digest}")
    if store.local:
        assert sorted(os.listdir(location)) == sorted([CONFIG_FILE, WEIGHTS_FILE])
    else:
        assert location.startswith("memory://")
    local = store.local_dir(digest)
    assert digest_dir(local) == digest and _files(local) == _files(src)
    assert store.local_dir(digest) == local  # cached copy reused
    assert _tmp_entries(store) == []


def test_put_weights_matches_save_adapter(store: AdapterStore, sites, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    a = random_adapter(sites, TARGETS["dense"], rank=4, seed=3)
    expected = save_adapter(a, tmp_path / "ref", sites)
    a.digest = None
    digest = store.put_weights(a, sites)
    assert digest == expected == a.digest
    assert store.read(digest) == _files(tmp_path / "ref")


def test_put_is_idempotent(
    store: AdapterStore, make_src: Callable[[int], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_src(0)
    digest = store.put_dir(src)
    before = (
        {n: os.stat(Path(store.path(digest)) / n) for n in (CONFIG_FILE, WEIGHTS_FILE)} if store.local else {}
    )
    writes: list[str] = []
    orig = AdapterStore._write_file

    def spy(self: AdapterStore, path: str, data: bytes) -> None:
        writes.append(path)
        orig(self, path, data)

    monkeypatch.setattr(AdapterStore, "_write_file", spy)
    assert store.put_dir(src) == digest
    assert writes == []  # nothing rewritten
    assert store.list() == [digest]
    for name, st in before.items():
        now = os.stat(Path(store.path(digest)) / name)
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)


def test_different_bytes_give_a_new_revision_and_leave_the_first(
    store: AdapterStore, make_src: Callable[[int], Path]
) -> None:
    a, b = make_src(0), make_src(1)
    da = store.put_dir(a)
    db = store.put_dir(b)
    assert da != db
    assert store.list() == sorted([da, db])
    assert store.read(da) == _files(a) and store.read(db) == _files(b)


def test_failed_write_leaves_nothing_visible(
    store: AdapterStore, make_src: Callable[[int], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_src(0)
    orig = AdapterStore._write_file
    calls: list[str] = []

    def fail_second(self: AdapterStore, path: str, data: bytes) -> None:
        calls.append(path)
        if len(calls) == 2:
            orig(self, path, data[: len(data) // 2])
            raise OSError(28, "No space left on device")
        orig(self, path, data)

    monkeypatch.setattr(AdapterStore, "_write_file", fail_second)
    digest = digest_dir(src)
    with pytest.raises(StoreUnavailable, match="No space left"):
        store.put_dir(src)
    assert calls[1].endswith(WEIGHTS_FILE)
    assert not store.exists(digest)
    assert store.list() == []
    with pytest.raises(UnknownRevision):
        store.read(digest)
    assert _tmp_entries(store) == []  # the failed put cleaned up after itself

    monkeypatch.setattr(AdapterStore, "_write_file", orig)
    assert store.put_dir(src) == digest and store.read(digest) == _files(src)


def test_fsspec_put_without_marker_is_absent(
    tmp_path: Path, make_src: Callable[[int], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AdapterStore(f"memory://mint-test-{uuid.uuid4().hex}", cache_dir=tmp_path / "cache")
    src = make_src(0)
    digest = digest_dir(src)
    orig = AdapterStore._write_file

    def no_marker(self: AdapterStore, path: str, data: bytes) -> None:
        if path.endswith(COMMITTED):
            raise OSError("connection reset")
        orig(self, path, data)

    monkeypatch.setattr(AdapterStore, "_write_file", no_marker)
    with pytest.raises(StoreUnavailable):
        store.put_dir(src)
    assert store.fs.exists(f"{store._rev(digest)}/{WEIGHTS_FILE}")  # the files got there, the marker did not
    assert not store.exists(digest) and store.list() == []
    with pytest.raises(UnknownRevision):
        store.local_dir(digest)
    assert store.gc(set()) == [digest]  # an uncommitted leftover is garbage
    assert not store.fs.exists(store._rev(digest))
    monkeypatch.setattr(AdapterStore, "_write_file", orig)
    assert store.put_dir(src) == digest and store.exists(digest)
    store.fs.rm(store.root, recursive=True)


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    from mint_core.lora.adapter import WEIGHTS_FILE
    from mint_core.registry.store import AdapterStore

    orig = AdapterStore._write_file

    def slow(self, path, data):
        if not path.endswith(WEIGHTS_FILE):
            return orig(self, path, data)
        with open(path, "wb") as f:
            f.write(data[: 1 << 20])
            f.flush()
            print("writing", flush=True)
            time.sleep(120)
            f.write(data[1 << 20 :])

    AdapterStore._write_file = slow
    AdapterStore(sys.argv[1]).put_dir(sys.argv[2])
    """
)


def test_sigkill_mid_write_leaves_nothing_visible_and_gc_cleans_tmp(
    tmp_path: Path, make_src: Callable[[int], Path]
) -> None:
    src = make_src(0)
    (src / WEIGHTS_FILE).write_bytes(os.urandom(8 << 20))  # large; the store is byte-level
    digest = digest_dir(src)
    root = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(root), str(src)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.strip() == "writing", proc.stderr.read() if proc.stderr else ""
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    store = AdapterStore(root)
    assert not store.exists(digest) and store.list() == []
    (leftover,) = _tmp_entries(store)
    assert (root / "tmp" / leftover / WEIGHTS_FILE).stat().st_size == 1 << 20  # half-written, out of sight
    assert store.gc(set()) == []  # fresh: within the grace period, maybe still being written
    assert store.gc(set(), grace_s=0) == [f"tmp/{leftover}"]
    assert _tmp_entries(store) == []
    assert store.put_dir(src) == digest and store.read(digest) == _files(src)


def test_corrupt_byte_is_caught_on_read(store: AdapterStore, make_src: Callable[[int], Path]) -> None:
    digest = store.put_dir(make_src(0))
    weights = f"{store._rev(digest)}/{WEIGHTS_FILE}"
    data = bytearray(store.fs.cat_file(weights))
    data[-1] ^= 0xFF
    if store.local:
        Path(weights).write_bytes(bytes(data))
    else:
        store.fs.pipe_file(weights, bytes(data))
    with pytest.raises(DigestMismatch, match=digest) as e:
        store.read(digest)
    assert e.value.digest == digest and e.value.actual != digest and e.value.actual in str(e.value)
    assert e.value.location == store.path(digest)
    with pytest.raises(DigestMismatch):
        store.local_dir(digest)


def test_corrupt_cache_copy_is_refetched(tmp_path: Path, make_src: Callable[[int], Path]) -> None:
    store = AdapterStore(f"memory://mint-test-{uuid.uuid4().hex}", cache_dir=tmp_path / "cache")
    digest = store.put_dir(make_src(0))
    local = store.local_dir(digest)
    assert local.is_relative_to(tmp_path / "cache")
    (local / WEIGHTS_FILE).write_bytes(b"garbage")
    assert digest_dir(store.local_dir(digest)) == digest
    store.fs.rm(store.root, recursive=True)


@pytest.mark.parametrize("keep", [(), (0,), (1, 2), (0, 1, 2)])
def test_gc_removes_exactly_the_unreferenced(
    store: AdapterStore, make_src: Callable[[int], Path], keep: tuple[int, ...]
) -> None:
    digests = [store.put_dir(make_src(i)) for i in range(3)]
    referenced = {digests[i] for i in keep}
    gone = sorted(set(digests) - referenced)
    assert store.gc(referenced, dry_run=True) == gone
    assert store.list() == sorted(digests)  # dry run removed nothing
    assert store.gc({f"sha256:{d}" for d in referenced}) == gone
    assert store.list() == sorted(referenced)
    for d in gone:
        assert not store.exists(d)
    for d in referenced:
        store.read(d)


def test_gc_cleans_only_stale_tmp(store: AdapterStore, make_src: Callable[[int], Path]) -> None:
    digest = store.put_dir(make_src(0))
    stale = f"{int(time.time()) - 7200}-{uuid.uuid4().hex}"
    fresh = f"{int(time.time())}-{uuid.uuid4().hex}"
    for name in (stale, fresh):
        store.fs.makedirs(f"{store.root}/tmp/{name}", exist_ok=True)
        store.fs.pipe_file(f"{store.root}/tmp/{name}/{WEIGHTS_FILE}", b"partial")
    assert store.gc({digest}, dry_run=True) == [f"tmp/{stale}"]
    assert sorted(_tmp_entries(store)) == sorted([stale, fresh])
    assert store.gc({digest}) == [f"tmp/{stale}"]
    assert _tmp_entries(store) == [fresh]
    assert store.gc({digest}, grace_s=0) == [f"tmp/{fresh}"]
    assert store.list() == [digest]


def test_unknown_revision(store: AdapterStore) -> None:
    assert not store.exists(MISSING)
    for op in (store.read, store.path, store.local_dir, store.delete):
        with pytest.raises(UnknownRevision, match=MISSING):
            op(MISSING)


def test_delete(store: AdapterStore, make_src: Callable[[int], Path]) -> None:
    a, b = store.put_dir(make_src(0)), store.put_dir(make_src(1))
    store.delete(a)
    assert store.list() == [b] and not store.exists(a)
    with pytest.raises(UnknownRevision):
        store.delete(a)


@pytest.mark.parametrize("bad", ["abc", "g" * 64, "sha256:xyz", "a" * 63, "a" * 65, ""])
def test_malformed_digest(store: AdapterStore, bad: str) -> None:
    for op in (store.exists, store.read, store.path, store.local_dir, store.delete):
        with pytest.raises(ValueError, match="malformed revision digest") as e:
            op(bad)
        assert repr(bad) in str(e.value)
    with pytest.raises(ValueError, match="malformed"):
        store.gc({bad})


def test_unwritable_root(tmp_path: Path, make_src: Callable[[int], Path]) -> None:
    src = make_src(0)
    if os.geteuid() == 0:  # chmod does not stop root: put the store under a regular file instead
        blocker = tmp_path / "a-file"
        blocker.write_text("not a directory")
        root = blocker / "store"
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        root = locked / "store"
    try:
        store = AdapterStore(root)
        with pytest.raises(StoreUnavailable, match="unavailable") as e:
            store.put_dir(src)
        assert str(root) in str(e.value) and isinstance(e.value.__cause__, OSError)
        assert not store.exists(digest_dir(src))
    finally:
        if os.geteuid() != 0:
            (tmp_path / "locked").chmod(0o700)


def test_unreadable_root_and_unknown_protocol(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(StoreUnavailable, match=str(blocker)):
        AdapterStore(blocker / "store").list()
    with pytest.raises(StoreUnavailable, match="nosuchproto://bucket"):
        AdapterStore("nosuchproto://bucket/adapters")


def test_empty_store_lists_nothing(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "never-created")
    assert store.list() == [] and store.gc(set()) == []
    assert AdapterStore(f"file://{tmp_path}/via-url").local
