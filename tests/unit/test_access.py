"""mint_core.access: the access file is written 0600 and atomically, refused when others may read it or when it
is not valid (naming the file and the field), made once on first start, changed under a lock without losing a
change, and read again by KeyRing on change (rotation without a restart; an invalid file keeps the last good
keys)."""

from __future__ import annotations

import json
import stat
import threading
from pathlib import Path

import pytest

from mint_core import access
from mint_core.access import Access, AccessError, KeyRing, ServingKey, User
from mint_testkit.waiting import wait_until


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_first_start_writes_an_admin_a_default_key_and_the_service_account_0600(tmp_path: Path) -> None:
    path = access.access_path(tmp_path / "run")
    found, made = access.ensure(path)
    assert made and _mode(path) == 0o600
    assert found.users[access.ADMIN_USER].role == "admin"
    assert found.keys[access.DEFAULT_KEY].policies == ["*"]
    assert found.service.mlflow_user == access.SERVICE_USER
    assert found.service.prefect_auth.startswith("mint:")
    # secrets are new each time and long enough
    assert len(found.users[access.ADMIN_USER].password) >= 24
    again, made_again = access.ensure(path)
    assert not made_again and again == found  # never rewritten: the same credentials


def test_save_load_round_trip_and_no_temporary_file_left(tmp_path: Path) -> None:
    path = tmp_path / "access.json"
    a = Access.first()
    a.users["rita"] = User(role="reviewer", password="p" * 16, policies=["shout", "tenant-a/*"])
    access.save(path, a)
    assert access.load(path) == a
    assert [p.name for p in tmp_path.iterdir()] == ["access.json"]
    assert _mode(path) == 0o600


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_file_others_may_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "access.json"
    access.save(path, Access.first())
    path.chmod(mode)
    with pytest.raises(AccessError, match=rf"{path}: .*open to others \(mode {mode:o}\).*chmod 600 {path}"):
        access.load(path)


def test_missing_unparsable_and_invalid_files_name_the_file_and_the_field(tmp_path: Path) -> None:
    path = tmp_path / "access.json"
    with pytest.raises(AccessError, match=rf"{path}: cannot read the access file"):
        access.load(path)
    path.write_text("{not json")
    path.chmod(0o600)
    with pytest.raises(AccessError, match=rf"{path}: not valid JSON"):
        access.load(path)
    doc = json.loads(Access.first().model_dump_json())
    doc["users"]["admin"]["role"] = "boss"
    path.write_text(json.dumps(doc))
    with pytest.raises(AccessError, match=r"users\.admin\.role"):
        access.load(path)
    doc["users"]["admin"]["role"] = "admin"
    doc["keys"]["bad name"] = doc["keys"].pop("default")
    path.write_text(json.dumps(doc))
    with pytest.raises(AccessError, match="'bad name' is not a valid name"):
        access.load(path)


def test_patterns_match_a_name_a_version_and_a_catalog_prefix() -> None:
    assert access.allows(["*"], "anything@v3")
    assert access.allows(["shout"], "shout") and access.allows(["shout"], "shout@v2")
    assert not access.allows(["shout"], "shouting")
    assert access.allows(["tenant-a/*"], "tenant-a/sum") and not access.allows(["tenant-a/*"], "tenant-b/sum")
    with pytest.raises(ValueError, match="without spaces"):
        ServingKey(secret="s" * 20, policies=["a b"])


def test_edit_saves_a_change_and_writes_nothing_when_the_block_fails(tmp_path: Path) -> None:
    path = tmp_path / "run" / "access.json"
    with pytest.raises(RuntimeError), access.edit(path) as (found, made):
        assert made
        found.keys["k"] = ServingKey(secret="s" * 20)
        raise RuntimeError("changed my mind")
    assert not path.exists()  # not even the first file
    with access.edit(path) as (found, made):
        found.keys["k"] = ServingKey(secret="s" * 20, policies=["shout"])
    assert made and access.load(path).keys["k"].policies == ["shout"]
    before = path.read_bytes()
    not_saved = rf"{path}: not saved: .*'bad name' is not a valid name"
    with pytest.raises(AccessError, match=not_saved), access.edit(path) as (found, _):
        found.users["bad name"] = User(role="viewer", password="p" * 16)
    assert path.read_bytes() == before


def test_edits_at_once_lose_no_change(tmp_path: Path) -> None:
    path = tmp_path / "access.json"
    access.ensure(path)

    def add(prefix: str) -> None:
        for i in range(15):
            with access.edit(path) as (found, _):
                found.keys[f"{prefix}{i}"] = ServingKey(secret=access.new_secret("mint-"))

    threads = [threading.Thread(target=add, args=(p,)) for p in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(access.load(path).keys) == 1 + 3 * 15


def test_keyring_rotation_and_revocation_without_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "access.json"
    a, _ = access.ensure(path)
    old = a.keys["default"].secret
    ring = KeyRing(path, recheck_s=0.05)
    assert ring.match(old) == ("default", a.keys["default"])
    assert ring.match("mint-not-a-key") is None and ring.match(None) is None and ring.match("") is None
    with access.edit(path) as (found, _):
        found.keys["default"] = ServingKey(secret=access.new_secret("mint-"))
        new = found.keys["default"].secret
    wait_until(lambda: ring.match(new) is not None, timeout=5, what="the rotated key is read")
    assert ring.match(old) is None
    with access.edit(path) as (found, _):
        del found.keys["default"]
    wait_until(lambda: ring.match(new) is None, timeout=5, what="the revoked key is refused")
    assert ring.names() == []


def test_keyring_keeps_the_last_good_keys_when_the_file_turns_invalid(tmp_path: Path) -> None:
    path = tmp_path / "access.json"
    a, _ = access.ensure(path)
    secret = a.keys["default"].secret
    ring = KeyRing(path, recheck_s=0.05)
    path.write_text("{half a file")  # mode stays 0600: invalid content
    wait_until(lambda: ring.match(secret) is not None and ring.error, timeout=5, what="the error is seen")
    assert "not valid JSON" in (ring.error or "")
    assert ring.match(secret) == ("default", a.keys["default"])
    path.write_text(a.model_dump_json())  # fixed: read again, error cleared
    wait_until(lambda: ring.names() and ring.error is None, timeout=5, what="the fixed file is read")
    assert ring.names() == ["default"]


def test_keyring_refuses_to_start_on_a_missing_or_open_file(tmp_path: Path) -> None:
    path = tmp_path / "access.json"
    with pytest.raises(AccessError, match="cannot read"):
        KeyRing(path)
    access.save(path, Access.first())
    path.chmod(0o644)
    with pytest.raises(AccessError, match="open to others"):
        KeyRing(path)
