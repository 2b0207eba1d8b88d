"""The fault suite's rows on a fleet of two vLLM replicas (issue #34, items 0 and 3), as `mint up --serving vllm
--replicas 2` starts it: sealed, supervised replicas, mint's front before them routing over them itself.

- `fleet-poison`: a NaN adapter forced with mint's key into one replica, behind the front's back, under traffic.
  The golden probe, which asks each replica at its own URL, finds it on that replica only; the front stops
  routing to it (no answer from it reaches a client after detection); its supervisor restarts it and it comes
  back clean, with the evidence logged naming it.
- `fleet-kill`: kill -9 of a replica under load: no request sent after the kill fails; it rejoins with the
  champion.
- `fleet-promote`: a promotion with a replica down completes; the replica returns on the new champion.
- `fleet-unreadable`: a replica that cannot read the new revision fails the promotion everywhere, named.
- `fleet-rogue` (issue #45, item 1): under load, a local process offers a server of its own as a worker through
  every admin route vllm-router had, on every port the stack listens on: the server receives no request and no
  answer of it reaches a client (alone: `scripts/faults.py --only fleet-rogue`, a fleet start and a minute).

Minutes (two vLLM starts, three restarts): the slow tier."""

from __future__ import annotations

import json

import pytest

from mint_core.serving.vllm_process import vllm_available
from mint_testkit.harness import VLLM_PYTHON, run_fault_suite
from mint_testkit.skips import require

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.faults, pytest.mark.timeout(3600)]
ROWS = ["fleet-poison", "fleet-kill", "fleet-promote", "fleet-unreadable", "fleet-rogue"]


def run_rows(tmp_path_factory: pytest.TempPathFactory, names: list[str]) -> dict[str, dict[str, object]]:
    require(vllm_available(VLLM_PYTHON), f"vLLM's environment ({VLLM_PYTHON.parent}, make vllm-venv)")
    out = tmp_path_factory.mktemp("fleet-faults") / "rows.json"
    run = run_fault_suite("--only", ",".join(names), "--json", str(out))
    assert out.is_file(), run.stdout[-3000:] + run.stderr[-5000:]
    got = json.loads(out.read_text())
    print(run.stdout)
    assert len(got) == len(names), got
    return {name: row for name, row in zip(names, got, strict=True)}


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    return run_rows(tmp_path_factory, ROWS)


def check(row: dict[str, object], *said: str) -> None:
    assert row["ok"] and row["lost"] == 0, row
    for text in said:
        assert text in str(row["result"]), (text, row["result"])


def test_a_poisoned_replica_is_found_on_its_own_routed_around_and_comes_back_clean(
    rows: dict[str, dict[str, object]],
) -> None:
    check(
        rows["fleet-poison"],
        "0 failed; unkeyed load on",
        "detected on 127.0.0.1:",
        "only: True",
        "out of rotation in the front's report: True",
        "0 from it after, 0 failed",
        "back clean: True",
        "evidence logged naming it: True",
    )


def test_a_killed_replica_fails_only_its_requests_in_flight_and_rejoins_on_the_champion(
    rows: dict[str, dict[str, object]],
) -> None:
    check(rows["fleet-kill"], " failed, ", "all the champion: True")
    assert ", 0 failed, " in str(rows["fleet-kill"]["result"]), rows["fleet-kill"]


def test_a_promotion_with_a_replica_down_completes_and_it_returns_on_the_new_champion(
    rows: dict[str, dict[str, object]],
) -> None:
    check(rows["fleet-promote"], "promotion completed", "champion v2", "then it holds v2: True")


def test_a_replica_that_cannot_read_the_revision_rolls_the_promotion_back_everywhere(
    rows: dict[str, dict[str, object]],
) -> None:
    row = rows["fleet-unreadable"]
    if str(row["result"]).startswith("not run"):
        # mounting in a replica's namespace needs CAP_SYS_ADMIN; a row not run still lost nothing
        check(row)
        pytest.skip(str(row["result"]))
    check(row, "naming 127.0.0.1:", ": True", "champion v1")


def test_a_local_process_cannot_add_a_worker_of_its_own(rows: dict[str, dict[str, object]]) -> None:
    check(
        rows["fleet-rogue"],
        "the rogue received 0 requests (0 with a key); 0 answers with its marker reached a client",
        "accepted anywhere: none",
    )
