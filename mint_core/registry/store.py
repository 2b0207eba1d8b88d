"""The adapter store: content-addressed, immutable adapter revisions on a local folder or any fsspec URL.

A revision is PEFT's two files (`adapter_config.json`, `adapter_model.safetensors`), addressed by the sha256
that `Digest.of_files` defines over both. It lives at `<root>/sha256/<first 2 hex>/<digest>/` and never changes.

Writes go to a temporary sibling `<root>/tmp/<unix seconds>-<uuid>/` first, then into place:
- a local root (a path, or a `file://` URL) renames the directory with `os.rename`, which is atomic, so the
  revision directory holds exactly the two files and either exists whole or not at all;
- any other fsspec root (`memory://`, `s3://`, ...) has no atomic directory rename, so the files are moved
  into place and a marker file `COMMITTED` is written last; a revision without the marker is absent to every
  reader (`exists`, `read`, `list`, ...) and a later `put` of the same bytes completes it.

A crash mid-write leaves at most a tmp directory (or, remotely, an uncommitted revision directory), never a
visible half revision; `gc` removes tmp directories older than a grace period. Reads verify the digest.

A ref (`add_ref(name, digest)`, a small file under `<root>/refs/`) keeps a revision that no catalog row names from
`gc` while its holder needs it: a Tinker training checkpoint lives in the store only, until its client deletes it.

The store handles bytes only and imports nothing of torch, so commands that read the registry stay fast;
`put_weights` (tensors -> PEFT files) imports the adapter format when it is called.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec.core
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from mint_core.errors import MintError
from mint_core.types import CONFIG_FILE, WEIGHTS_FILE, Digest, Site

if TYPE_CHECKING:
    from mint_core.lora.adapter import AdapterWeights, Layout

COMMITTED = "COMMITTED"
FILES = (CONFIG_FILE, WEIGHTS_FILE)
DEFAULT_TMP_GRACE_S = 3600.0
_HEX64 = re.compile(r"^[0-9a-f]{64}$")  # a revision directory's name
_TMP_NAME = re.compile(r"^(?P<t>\d+)-[0-9a-f]{32}$")


class StoreError(MintError):
    """An adapter store operation failed."""


class UnknownRevision(StoreError, KeyError):
    """No revision with this digest is in the store."""

    def __init__(self, digest: Digest, root: str):
        self.digest = digest
        self.root = root
        super().__init__(f"no adapter revision {digest.prefixed} in the store at {root}")

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class CorruptRevision(StoreError):
    """A stored revision is damaged (a file missing, or bytes that no longer match the digest)."""


class DigestMismatch(CorruptRevision):
    """A stored revision's bytes no longer hash to its digest."""

    def __init__(self, digest: Digest, actual: Digest, location: str):
        self.digest = digest
        self.actual = actual
        self.location = location
        super().__init__(
            f"adapter revision {digest.prefixed} at {location} is corrupt: its bytes hash to {actual.prefixed}"
        )


class StoreUnavailable(StoreError):
    """The store root cannot be reached, read or written."""

    def __init__(self, root: str, cause: BaseException | str):
        self.root = root
        self.cause = cause
        why = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else cause
        super().__init__(f"adapter store at {root} is unavailable ({why})")


def _default_cache_dir(root: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "mint" / "store" / hashlib.sha256(root.encode()).hexdigest()[:16]


class AdapterStore:
    """Content-addressed adapter revisions under `root` (a local path or an fsspec URL)."""

    def __init__(
        self,
        root: str | Path,
        cache_dir: str | Path | None = None,
        tmp_grace_s: float = DEFAULT_TMP_GRACE_S,
        storage_options: dict[str, Any] | None = None,
    ):
        self.root_url = str(root)
        self.tmp_grace_s = tmp_grace_s
        fs: AbstractFileSystem
        if isinstance(root, Path) or "://" not in self.root_url:
            fs, path = LocalFileSystem(), str(Path(root).expanduser().absolute())
        else:
            try:
                fs, path = fsspec.core.url_to_fs(self.root_url, **(storage_options or {}))
            except (ImportError, ValueError, OSError) as e:
                raise StoreUnavailable(self.root_url, e) from e
        self.fs = fs
        self.local = isinstance(fs, LocalFileSystem)
        self.root = path.rstrip("/") or "/"
        self.cache_dir = Path(cache_dir) if cache_dir is not None else _default_cache_dir(self.root_url)

    def __repr__(self) -> str:
        return f"AdapterStore({self.root_url!r})"

    # ---- layout ------------------------------------------------------------------------------------------

    def _rev(self, digest: str) -> str:
        return f"{self.root}/sha256/{digest[:2]}/{digest}"

    def _location(self, path: str) -> str:
        return path if self.local else self.fs.unstrip_protocol(path)

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """OSError from the filesystem -> StoreUnavailable naming the root."""
        try:
            yield
        except StoreError:
            raise
        except OSError as e:
            raise StoreUnavailable(self.root_url, e) from e

    def _committed(self, digest: str) -> bool:
        rev = self._rev(digest)
        if self.local:
            return os.path.isdir(rev)
        return bool(self.fs.exists(f"{rev}/{COMMITTED}"))

    def _write_file(self, path: str, data: bytes) -> None:
        """Write one file durably (the seam tests patch to simulate a crash)."""
        if self.local:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            self.fs.pipe_file(path, data)

    def _new_tmp(self) -> tuple[str, str]:
        name = f"{int(time.time())}-{uuid.uuid4().hex}"
        return name, f"{self.root}/tmp/{name}"

    def _rm(self, path: str) -> None:
        self.fs.rm(path, recursive=True)

    # ---- writing -----------------------------------------------------------------------------------------

    def put_dir(self, src_dir: str | Path) -> Digest:
        """Store the revision in `src_dir` (PEFT's two files); returns its digest. Idempotent."""
        src = Path(src_dir)
        data: dict[str, bytes] = {}
        for name in FILES:
            try:
                data[name] = (src / name).read_bytes()
            except FileNotFoundError as e:
                raise FileNotFoundError(f"{src} is not an adapter revision directory: no {name}") from e
        return self.put_bytes(data[CONFIG_FILE], data[WEIGHTS_FILE])

    def put_bytes(self, config_bytes: bytes, weights_bytes: bytes) -> Digest:
        """Store a revision given its two files' bytes; returns its digest. Idempotent."""
        digest = Digest.of_files(config_bytes, weights_bytes)
        with self._guard():
            if self._committed(digest):
                return digest
            _, tmp = self._new_tmp()
            try:
                self.fs.makedirs(tmp, exist_ok=True)
                self._write_file(f"{tmp}/{CONFIG_FILE}", config_bytes)
                self._write_file(f"{tmp}/{WEIGHTS_FILE}", weights_bytes)
                if self.local:
                    self._commit_local(tmp, digest)
                else:
                    self._commit_remote(tmp, digest)
            except BaseException:
                with contextlib.suppress(Exception):
                    if self.fs.exists(tmp):
                        self._rm(tmp)
                raise
        return digest

    def _commit_local(self, tmp: str, digest: str) -> None:
        rev = self._rev(digest)
        parent = os.path.dirname(rev)
        os.makedirs(parent, exist_ok=True)
        try:
            os.rename(tmp, rev)
        except OSError:
            if not os.path.isdir(rev):
                raise
            shutil.rmtree(tmp)  # a concurrent put of the same revision won; its bytes are ours
            return
        with contextlib.suppress(OSError):  # make the rename itself durable where the platform allows
            fd = os.open(parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _commit_remote(self, tmp: str, digest: str) -> None:
        rev = self._rev(digest)
        self.fs.makedirs(rev, exist_ok=True)
        for name in FILES:
            self.fs.mv(f"{tmp}/{name}", f"{rev}/{name}")
        self._write_file(f"{rev}/{COMMITTED}", digest.encode() + b"\n")  # last: the revision now exists
        with contextlib.suppress(Exception):
            if self.fs.exists(tmp):
                self.fs.rm(tmp, recursive=True)

    def put_weights(
        self, adapter_weights: AdapterWeights, sites: dict[str, Site], layout: Layout = "packed"
    ) -> Digest:
        """Write `adapter_weights` in PEFT format (via `save_adapter`) and store it; returns its digest."""
        # deferred: the adapter format imports torch, which nothing else in the store needs
        from mint_core.lora.adapter import save_adapter

        with tempfile.TemporaryDirectory(prefix="mint-put-") as d:
            save_adapter(adapter_weights, Path(d) / "rev", sites, layout)
            digest = self.put_dir(Path(d) / "rev")
        adapter_weights.digest = digest
        return digest

    # ---- reading -----------------------------------------------------------------------------------------

    def exists(self, digest: str) -> bool:
        digest = Digest.parse(digest)
        with self._guard():
            return self._committed(digest)

    def _require(self, digest: str) -> Digest:
        digest = Digest.parse(digest)
        with self._guard():
            if not self._committed(digest):
                raise UnknownRevision(digest, self.root_url)
        return digest

    def path(self, digest: str) -> str:
        """Where the revision lives: a local directory path, or a URL for fsspec roots."""
        digest = self._require(digest)
        return self._location(self._rev(digest))

    def read(self, digest: str) -> tuple[bytes, bytes]:
        """The revision's (config bytes, weights bytes), verified against its digest."""
        digest = self._require(digest)
        rev = self._rev(digest)
        location = self._location(rev)
        out: list[bytes] = []
        with self._guard():
            for name in FILES:
                try:
                    out.append(self.fs.cat_file(f"{rev}/{name}"))
                except FileNotFoundError as e:
                    raise CorruptRevision(
                        f"adapter revision {digest.prefixed} at {location} is corrupt: {name} is missing"
                    ) from e
        actual = Digest.of_files(out[0], out[1])
        if actual != digest:
            raise DigestMismatch(digest, actual, location)
        return out[0], out[1]

    def local_dir(self, digest: str) -> Path:
        """A verified local directory holding the revision's two files (for fsspec roots, a cached copy)."""
        digest = Digest.parse(digest)
        if self.local:
            self.read(digest)
            return Path(self._rev(digest))
        target = self.cache_dir / "sha256" / digest[:2] / digest
        if target.is_dir():
            cached: str = ""
            with contextlib.suppress(FileNotFoundError):
                cached = Digest.of_files(*((target / n).read_bytes() for n in FILES))
            if cached == digest:
                return target
            shutil.rmtree(target)
        config_bytes, weights_bytes = self.read(digest)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:8]}-", dir=target.parent))
        try:
            (tmp / CONFIG_FILE).write_bytes(config_bytes)
            (tmp / WEIGHTS_FILE).write_bytes(weights_bytes)
            try:
                os.rename(tmp, target)
            except OSError:
                if not target.is_dir():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        return target

    def list(self) -> list[Digest]:
        """Digests of every (committed) revision, sorted."""
        with self._guard():
            return sorted(d for d, committed in self._scan() if committed)

    def _ls_names(self, path: str) -> builtins.list[str]:
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return [str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def _scan(self) -> Iterator[tuple[Digest, bool]]:
        """(digest, committed) for every revision directory, committed or not."""
        for shard in self._ls_names(f"{self.root}/sha256"):
            for name in self._ls_names(f"{self.root}/sha256/{shard}"):
                if _HEX64.match(name) and name[:2] == shard:
                    yield Digest.trusted(name), self._committed(name)

    # ---- refs ---------------------------------------------------------------------------------------------

    def _ref(self, name: str) -> str:
        return f"{self.root}/refs/{hashlib.sha256(name.encode()).hexdigest()}.json"

    def add_ref(self, name: str, digest: str) -> None:
        """Keep `digest` from `gc` under `name` (one digest per name; adding again moves it). Idempotent."""
        digest = self._require(digest)
        with self._guard():
            self.fs.makedirs(f"{self.root}/refs", exist_ok=True)
            self._write_file(self._ref(name), json.dumps({"name": name, "digest": str(digest)}).encode())

    def remove_ref(self, name: str) -> bool:
        """Drop the ref `name`; False when there was none."""
        with self._guard():
            try:
                self.fs.rm(self._ref(name))
            except FileNotFoundError:
                return False
        return True

    def refs(self) -> dict[str, Digest]:
        """Every ref: name -> the digest it keeps."""
        out: dict[str, Digest] = {}
        with self._guard():
            for file in self._ls_names(f"{self.root}/refs"):
                try:
                    ref = json.loads(self.fs.cat_file(f"{self.root}/refs/{file}"))
                    out[str(ref["name"])] = Digest.parse(ref["digest"])
                except FileNotFoundError:
                    continue  # removed while listed
                except (ValueError, KeyError, TypeError) as e:
                    raise CorruptRevision(
                        f"ref {file} in the store at {self.root_url} is unreadable: {e}"
                    ) from e
        return out

    # ---- removing ----------------------------------------------------------------------------------------

    def delete(self, digest: str) -> None:
        """Remove one revision; UnknownRevision if it is not there."""
        digest = self._require(digest)
        rev = self._rev(digest)
        with self._guard():
            if self.local:
                # vanish atomically, then clean up out of sight
                _, tmp = self._new_tmp()
                os.makedirs(os.path.dirname(tmp), exist_ok=True)
                os.rename(rev, tmp)
                shutil.rmtree(tmp)
            else:
                self.fs.rm(f"{rev}/{COMMITTED}")  # first: readers see it gone at once
                self.fs.rm(rev, recursive=True)

    def _tmp_age(self, name: str, path: str, now: float) -> float:
        m = _TMP_NAME.match(name)
        if m:
            return now - int(m["t"])
        newest = None
        with contextlib.suppress(Exception):
            for info in self.fs.find(path, detail=True, withdirs=True).values():
                for key in ("mtime", "created", "LastModified"):
                    t = info.get(key)
                    if hasattr(t, "timestamp"):
                        t = t.timestamp()
                    if isinstance(t, int | float):
                        newest = t if newest is None else max(newest, float(t))
        return float("inf") if newest is None else now - newest

    def gc(
        self, referenced: set[str], dry_run: bool = False, grace_s: float | None = None
    ) -> builtins.list[str]:
        """Remove every revision whose digest is not in `referenced` nor kept by a ref, and tmp directories older
        than the grace period (`grace_s`, default the store's `tmp_grace_s`). Returns what was (or, with `dry_run`, would be)
        removed: digests for revisions, `tmp/<name>` for tmp directories.

        Run it only when no put is in flight whose digest is not yet referenced (a fresh revision is
        unreferenced until the catalog records it).
        """
        keep = {Digest.parse(d) for d in referenced} | set(self.refs().values())
        grace = self.tmp_grace_s if grace_s is None else grace_s
        removed: builtins.list[str] = []
        now = time.time()
        with self._guard():
            for digest, committed in sorted(self._scan()):
                if digest in keep:
                    continue
                if not dry_run:
                    if committed:
                        self.delete(digest)
                    else:  # an fsspec put that died before its marker; invisible, so just remove it
                        self.fs.rm(self._rev(digest), recursive=True)
                removed.append(digest)
            for name in self._ls_names(f"{self.root}/tmp"):
                path = f"{self.root}/tmp/{name}"
                if self._tmp_age(name, path, now) < grace:
                    continue
                if not dry_run:
                    self._rm(path)
                removed.append(f"tmp/{name}")
        return removed
