"""Addresses: the four ways to name an adapter revision anywhere one is named, parsed without a database.

policy            the policy's champion (same as `policy@champion`)
policy@alias      a movable pointer, e.g. `p@candidate`
policy/v7         one version of a policy; versions count up from 1 per policy
sha256:<hex>      the revision itself (64 lowercase hex digits)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from mint_core.errors import MintError
from mint_core.types import Digest

CHAMPION = "champion"
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
NAME_RE = re.compile(_NAME)
_HEX64_RE = re.compile(r"[0-9a-f]{64}")
_VERSION_RE = re.compile(r"v([1-9][0-9]{0,17})")
_FORMS = "`policy`, `policy@alias`, `policy/v<N>` (N >= 1) or `sha256:<64 lowercase hex>`"


class CatalogError(MintError):
    """The catalog could not do what was asked; nothing was changed."""


class AddressError(CatalogError, ValueError):
    """An address that is not well formed; names the input and the forms expected."""


# ---- addresses ----------------------------------------------------------------------------------------------


AddressKind = Literal["policy", "alias", "version", "digest"]


@dataclass(frozen=True, slots=True)
class Address:
    """A parsed address; `str(address)` gives its canonical spelling."""

    kind: AddressKind
    policy: str | None = None
    alias: str | None = None
    version: int | None = None
    digest: Digest | None = None

    def __str__(self) -> str:
        if self.kind == "digest":
            assert self.digest is not None
            return self.digest.prefixed
        if self.kind == "alias":
            return f"{self.policy}@{self.alias}"
        if self.kind == "version":
            return f"{self.policy}/v{self.version}"
        return str(self.policy)


def _bad(s: object, why: str) -> AddressError:
    return AddressError(f"malformed address {s!r}: {why}; expected {_FORMS}")


def check_name(s: str, what: str, name: str) -> None:
    if not name:
        raise _bad(s, f"empty {what}")
    if not NAME_RE.fullmatch(name):
        raise _bad(s, f"{what} {name!r} must be 1-128 of [A-Za-z0-9._-], starting with a letter or digit")


def parse_address(s: str) -> Address:
    """Parse one of the four address forms; anything else raises `AddressError` naming the input."""
    if not isinstance(s, str):
        raise _bad(s, f"not a string but {type(s).__name__}")
    if not s:
        raise _bad(s, "empty")
    if s.startswith("sha256:"):
        hex_ = s.removeprefix("sha256:")
        if not _HEX64_RE.fullmatch(hex_):
            raise _bad(s, f"digest must be 64 lowercase hex digits, got {len(hex_)} characters")
        return Address("digest", digest=Digest.trusted(hex_))
    if "@" in s:
        policy, _, alias = s.partition("@")
        check_name(s, "policy", policy)
        check_name(s, "alias", alias)
        return Address("alias", policy=policy, alias=alias)
    if "/" in s:
        policy, _, rest = s.partition("/")
        check_name(s, "policy", policy)
        m = _VERSION_RE.fullmatch(rest)
        if not m:
            raise _bad(s, f"version must be `v` and a number >= 1 without leading zeros, got {rest!r}")
        return Address("version", policy=policy, version=int(m.group(1)))
    check_name(s, "policy", s)
    return Address("policy", policy=s)
