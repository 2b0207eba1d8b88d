"""Which registry versions to keep: every aliased version, the lineage of aliased versions, and the newest N of
each policy. The rest may be deleted (`Registry.delete_versions`), after which `mint catalog gc` frees their bytes.

Lineage (`mint.parent`, `policy/vN`, or a digest within the same policy) crosses policies, so `plan_retention`
decides over a snapshot of the whole registry (`RegistryReader.everything`): no deletion may cut the ancestry of
any aliased revision. Reads only: nothing here imports `mlflow`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from mint_core.registry.address import AddressError, parse_address
from mint_core.registry.reader import Revision


@dataclass
class RetentionPlan:
    """One policy's versions, each kept (with why) or to delete."""

    policy: str
    keep: dict[int, str] = field(default_factory=dict)
    """version -> why it stays (`alias champion`, `ancestor of p/v7 (champion)`, `newest 5`)."""
    delete: list[int] = field(default_factory=list)
    """Versions no rule keeps, oldest first."""


def _parent(
    rev: Revision, by_address: Mapping[str, Revision], by_digest: Mapping[tuple[str, str], Revision]
) -> Revision | None:
    if not rev.parent:
        return None
    try:
        addr = parse_address(rev.parent)
    except AddressError:
        return None
    if addr.kind == "version":
        return by_address.get(str(addr))
    if addr.kind == "digest" and addr.digest is not None:
        return by_digest.get((rev.policy, str(addr.digest)))
    return None


def protected(
    aliased: Mapping[str, Mapping[str, int]],
    revisions: Iterable[Revision],
    lineage_of: Callable[[str], bool] = lambda alias: True,
) -> dict[str, str]:
    """address -> why it must stay: every aliased version, and every ancestor (through `mint.parent`, across the
    policies in `revisions`) of a version named by an alias for which `lineage_of(alias)` holds."""
    revs = list(revisions)
    by_address = {r.address: r for r in revs}
    by_digest: dict[tuple[str, str], Revision] = {}
    for r in sorted(revs, key=lambda r: r.version):  # a digest parent means its oldest version
        by_digest.setdefault((r.policy, str(r.digest)), r)
    out: dict[str, str] = {}
    for policy, names in sorted(aliased.items()):
        for alias, version in sorted(names.items()):
            out.setdefault(f"{policy}/v{version}", f"alias {alias}")
    for policy, names in sorted(aliased.items()):
        for alias, version in sorted(names.items()):
            address = f"{policy}/v{version}"
            if not lineage_of(alias):
                continue
            rev, seen = by_address.get(address), {address}
            while rev is not None:
                rev = _parent(rev, by_address, by_digest)
                if rev is None or rev.address in seen:
                    break
                seen.add(rev.address)
                out.setdefault(rev.address, f"ancestor of {address} ({alias})")
    return out


def plan_retention(
    policy: str, revisions: Iterable[Revision], guard: Mapping[str, str], keep_last: int
) -> RetentionPlan:
    """Keep what `guard` (from `protected`) names and the newest `keep_last` versions of `policy`; the rest go."""
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0, got {keep_last}")
    mine = sorted((r for r in revisions if r.policy == policy), key=lambda r: r.version)
    newest = {r.version for r in mine[len(mine) - keep_last :]} if keep_last else set()
    plan = RetentionPlan(policy)
    for r in mine:
        why = guard.get(r.address) or (f"newest {keep_last}" if r.version in newest else None)
        if why is None:
            plan.delete.append(r.version)
        else:
            plan.keep[r.version] = why
    return plan
