"""A revision digest is one type, parsed once where it enters; the registry's one retry policy retries only
transient errors."""

from __future__ import annotations

import sqlite3

import pytest
import sqlalchemy as sa
from pydantic import BaseModel

from mint_core.registry.retry import is_transient, retried
from mint_core.types import Digest, DigestError

HEX = "0123456789abcdef" * 4


@pytest.mark.parametrize("text", [HEX, f"sha256:{HEX}", Digest(HEX)])
def test_parse_bare_or_prefixed(text: str) -> None:
    d = Digest.parse(text)
    assert d == HEX and d.hex == HEX and type(d.hex) is str
    assert d.prefixed == f"sha256:{HEX}" and d.short == HEX[:12]
    assert repr(d) == f"Digest('sha256:{HEX}')"
    assert {d: 1}[HEX] == 1  # the same key as its bare hex (tables, tags, store paths)


@pytest.mark.parametrize(
    "bad", ["", "abc", HEX.upper(), f"sha256:{HEX}0", "sha256:", f"md5:{HEX}", "g" * 64, None, 42]
)
def test_malformed_names_the_text(bad: object) -> None:
    with pytest.raises(DigestError, match="malformed revision digest") as e:
        Digest.parse(bad)
    assert repr(bad) in str(e.value)
    assert isinstance(e.value, ValueError)


def test_of_files_is_the_store_digest() -> None:
    from mint_core.lora.adapter import digest_files

    d = Digest.of_files(b"{}", b"weights")
    assert isinstance(d, Digest) and d == digest_files(b"{}", b"weights")


def test_pydantic_field_parses_and_serialises_bare_hex() -> None:
    class M(BaseModel):
        digest: Digest

    m = M(digest=f"sha256:{HEX}")
    assert type(m.digest) is Digest and m.model_dump() == {"digest": HEX}
    assert M.model_validate_json(m.model_dump_json()) == m
    with pytest.raises(ValueError, match="malformed revision digest"):
        M(digest="nope")


def _db_error(cls: type[sa.exc.DBAPIError], text: str) -> sa.exc.DBAPIError:
    return cls("INSERT ...", {}, sqlite3.OperationalError(text))


@pytest.mark.parametrize(
    ("case", "error", "retry"),
    [
        ("locked SQLite", _db_error(sa.exc.OperationalError, "database is locked"), True),
        ("deadlock", _db_error(sa.exc.OperationalError, "deadlock detected"), True),
        ("serialization", _db_error(sa.exc.OperationalError, "could not serialize access"), True),
        ("key taken", _db_error(sa.exc.IntegrityError, "UNIQUE constraint failed: versions.policy"), True),
        ("foreign key", _db_error(sa.exc.IntegrityError, "FOREIGN KEY constraint failed"), False),
        ("no such table", _db_error(sa.exc.OperationalError, "no such table: revisions"), False),
        ("refused", ConnectionRefusedError(111, "Connection refused"), True),
        ("MLflow's refused", RuntimeError("API request failed: Connection refused"), True),
        ("bad argument", ValueError("rank must be >= 1"), False),
    ],
)
def test_transient_errors(case: str, error: BaseException, retry: bool) -> None:
    assert is_transient(error) is retry, case


def test_retried_runs_again_only_on_transient_errors() -> None:
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise _db_error(sa.exc.OperationalError, "database is locked")
        return "ok"

    assert retried(flaky) == "ok" and len(calls) == 3

    def broken() -> None:
        calls.append(1)
        raise ValueError("bad")

    calls.clear()
    with pytest.raises(ValueError, match="bad"):
        retried(broken)
    assert len(calls) == 1
