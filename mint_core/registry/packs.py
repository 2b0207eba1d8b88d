"""Packs: many small adapter revisions of one shape in one safetensors file.

A million rank-1 revisions as a million pairs of files is a million inodes and a million opens; a pack holds
up to a few thousand of them stacked per site (`A.<site>` [n, r, in], `B.<site>` [n, out, r]) with their digests
in the header. Each member is still a revision of its own: its digest is that of the PEFT files it exports to
(computed when the pack is written), and its catalog location is `<pack file>#<index>`.

Reading a member checks what reading its PEFT files would (shapes against the base, rank, finite values, base
fingerprint) directly on its tensors, and verifies a sha256 of its tensor bytes recorded at write time, so a pack
changed on disk is caught on read without rebuilding the PEFT bytes (a tenth of the cost).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mint_core.errors import AdapterError
from mint_core.lora.adapter import AdapterWeights, adapter_bytes
from mint_core.lora.validate import BaseSpec
from mint_core.types import Digest, Site

PACK_KEY = "mint.pack"
DIGESTS = "mint.digests"
CHECKSUMS = "mint.checksums"
MAX_PACK = 65536


def is_pack_location(location: str) -> bool:
    head, sep, index = location.rpartition("#")
    return bool(sep) and index.isdigit() and head.endswith(".safetensors")


def write_pack(path: str | Path, adapters: Sequence[AdapterWeights], sites: dict[str, Site]) -> list[Digest]:
    """Write `adapters` (same rank, alpha, sites and base) into one pack file, atomically; returns their
    digests in order (a member's location is `f"{path}#{i}"`)."""
    if not adapters:
        raise ValueError("a pack needs at least one adapter")
    if len(adapters) > MAX_PACK:
        raise ValueError(f"a pack holds at most {MAX_PACK} adapters, got {len(adapters)}")
    first = adapters[0]
    shape = (
        first.rank,
        first.alpha,
        first.use_rslora,
        first.base_fingerprint,
        first.base_name,
        sorted(first.tensors),
    )
    for i, a in enumerate(adapters):
        if (a.rank, a.alpha, a.use_rslora, a.base_fingerprint, a.base_name, sorted(a.tensors)) != shape:
            raise ValueError(
                f"adapter {i} differs from adapter 0 in rank, alpha, base or sites; packs are uniform"
            )
    digests = [Digest.of_files(*adapter_bytes(a, sites)) for a in adapters]
    checksums = [_checksum(a.tensors) for a in adapters]
    tensors: dict[str, torch.Tensor] = {}
    for site in first.tensors:
        # kept in the members' own dtype: the digest covers their bytes as they are
        tensors[f"A.{site}"] = torch.stack([a.tensors[site][0] for a in adapters]).contiguous()
        tensors[f"B.{site}"] = torch.stack([a.tensors[site][1] for a in adapters]).contiguous()
    meta = {
        "rank": first.rank,
        "alpha": first.alpha,
        "use_rslora": first.use_rslora,
        "base_fingerprint": first.base_fingerprint,
        "base_name": first.base_name,
        "n": len(adapters),
    }
    # digests and checksums as [n, 32] byte tensors, not header JSON: opening a pack then parses a few hundred
    # bytes of header instead of half a megabyte, which is what a cold load of a random member pays
    tensors[DIGESTS] = torch.tensor([list(bytes.fromhex(d)) for d in digests], dtype=torch.uint8)
    tensors[CHECKSUMS] = torch.tensor([list(bytes.fromhex(c)) for c in checksums], dtype=torch.uint8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata={PACK_KEY: json.dumps(meta)})
    os.replace(tmp, path)
    return digests


class PackReader:
    """Reads members of pack files, keeping the last few files open (members of one pack are read together)."""

    def __init__(self, sites: dict[str, Site], open_files: int = 64):
        self.sites = sites
        self.open_files = open_files
        self._open: dict[str, tuple[object, dict]] = {}

    def _handle(self, path: str) -> tuple[object, dict]:
        hit = self._open.pop(path, None)
        if hit is None:
            f = safe_open(path, framework="pt")
            meta = json.loads((f.metadata() or {})[PACK_KEY])
            hit = (f, meta)
            while len(self._open) >= self.open_files:
                self._open.pop(next(iter(self._open)))
        self._open[path] = hit
        return hit

    def read_many(
        self, path: str, members: list[tuple[int, str]], spec: BaseSpec
    ) -> list[AdapterWeights | AdapterError]:
        """Members (index, label) of one pack, each checked like `read`, reading each site's rows once."""
        try:
            f, meta = self._handle(path)
        except (OSError, KeyError, ValueError, json.JSONDecodeError) as e:
            return [
                AdapterError(label, f"{path}#{i}", [f"pack file unreadable: {e}"]) for i, label in members
            ]
        n = int(meta["n"])
        good = [i for i, _ in members if 0 <= i < n]
        rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        lo = min(good) if good else 0
        if good:
            hi = max(good) + 1
            for key in f.keys():  # type: ignore[attr-defined]  # noqa: SIM118 (a safetensors handle, not a dict)
                if key.startswith("A."):
                    site = key[2:]
                    rows[site] = (f.get_slice(key)[lo:hi], f.get_slice(f"B.{site}")[lo:hi])  # type: ignore[attr-defined]
            digests = f.get_slice(DIGESTS)[lo:hi]  # type: ignore[attr-defined]
            checksums = f.get_slice(CHECKSUMS)[lo:hi]  # type: ignore[attr-defined]
        out: list[AdapterWeights | AdapterError] = []
        for i, label in members:
            location = f"{path}#{i}"
            if not 0 <= i < n:
                out.append(AdapterError(label, location, [f"index {i} is outside the pack (it holds {n})"]))
                continue
            tensors = {site: (A[i - lo].clone(), B[i - lo].clone()) for site, (A, B) in rows.items()}
            out.append(
                self._member(
                    tensors,
                    meta,
                    spec,
                    Digest(_hex(digests[i - lo])),
                    _hex(checksums[i - lo]),
                    label,
                    location,
                )
            )
        return out

    def read(self, location: str, spec: BaseSpec, name: str | None = None) -> AdapterWeights:
        """The member at `<pack>#<i>`, validated against the base and verified against its recorded digest."""
        path, _, index_text = location.rpartition("#")
        if not path or not index_text.isdigit():
            raise AdapterError(name or location, location, ["a pack location is <pack file>#<member index>"])
        (member,) = self.read_many(path, [(int(index_text), name or location)], spec)
        if isinstance(member, AdapterError):
            raise member
        return member

    @staticmethod
    def _member(
        tensors: dict[str, tuple[torch.Tensor, torch.Tensor]],
        meta: dict,
        spec: BaseSpec,
        digest: Digest,
        checksum: str,
        label: str,
        location: str,
    ) -> AdapterWeights | AdapterError:
        problems = _check_member(tensors, meta, spec)
        if _checksum(tensors) != checksum:
            problems.append("checksum mismatch: the member's bytes changed since the pack was written")
        if problems:
            return AdapterError(label, location, problems)
        return AdapterWeights(
            meta["rank"],
            meta["alpha"],
            {k: (a.float(), b.float()) for k, (a, b) in tensors.items()},
            spec.fingerprint,
            meta["base_name"],
            meta["use_rslora"],
            digest=digest,
        )


def _hex(row: torch.Tensor) -> str:
    return bytes(row.tolist()).hex()


def _checksum(tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for site in sorted(tensors):
        for t in tensors[site]:
            h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _check_member(
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]], meta: dict, spec: BaseSpec
) -> list[str]:
    """What `validate_bytes` would find wrong with the member's PEFT files, checked on its tensors."""
    problems: list[str] = []
    rank = meta["rank"]
    if rank > spec.max_rank:
        problems.append(f"rank {rank} is above the engine's max rank {spec.max_rank}")
    fp = meta.get("base_fingerprint")
    if fp is not None and fp != spec.fingerprint:
        problems.append(f"made for base {fp[:12]}, but this engine's base is {spec.fingerprint[:12]}")
    for name, (A, B) in tensors.items():
        site = spec.sites.get(name)
        if site is None:
            problems.append(f"target {name} is not a LoRA site of this engine")
            continue
        lead = (site.experts,) if site.experts else ()
        if tuple(A.shape) != (*lead, rank, site.in_features) or tuple(B.shape) != (
            *lead,
            site.out_features,
            rank,
        ):
            problems.append(f"target {name}: shapes A{tuple(A.shape)} B{tuple(B.shape)} do not fit the base")
        if not (bool(torch.isfinite(A).all()) and bool(torch.isfinite(B).all())):
            problems.append(f"target {name} has non-finite values")
    return problems
