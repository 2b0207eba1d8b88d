"""MLflow tag values within MLflow's limit: text cut with a mark, JSON shrunk by its fields and still JSON."""

from __future__ import annotations

import json

import pytest

from mint_core.registry.tags import CUT, TAG_MAX_CHARS, fit_tag, json_tag


def test_text_that_fits_is_kept_and_longer_text_is_cut_with_a_mark() -> None:
    assert fit_tag("v1 -> v2 by me: better") == "v1 -> v2 by me: better"
    assert fit_tag("x" * TAG_MAX_CHARS) == "x" * TAG_MAX_CHARS
    cut = fit_tag("y" * (TAG_MAX_CHARS + 1))
    assert len(cut) == TAG_MAX_CHARS and cut.endswith(CUT) and cut.startswith("y" * 100)


def test_json_that_fits_is_compact_and_unmarked() -> None:
    doc = {"share": 0.1, "decision": "promoted", "reason": "p < 0.05"}
    assert json_tag(doc) == '{"share":0.1,"decision":"promoted","reason":"p < 0.05"}'


@pytest.mark.parametrize("quote", ["x", '"', "\n", "é"])  # escapes make the JSON longer than the string
def test_a_long_string_field_is_cut_inside_the_json(quote: str) -> None:
    # the canary's record: a long reason (the online test's prose) used to be cut with the JSON around it
    doc = {"share": 0.1, "decision": "rolled back", "reason": quote * 20_000, "run_id": "abc"}
    tag = json_tag(doc, shrink=("reason",))
    assert len(tag) <= TAG_MAX_CHARS
    back = json.loads(tag)
    assert back["truncated"] is True
    assert {k: back[k] for k in ("share", "decision", "run_id")} == {
        "share": 0.1,
        "decision": "rolled back",
        "run_id": "abc",
    }
    assert back["reason"].endswith(CUT) and back["reason"].startswith(quote)
    assert len(tag) > TAG_MAX_CHARS - 20  # cut to the limit, not far below it


def test_named_fields_lose_their_last_items_in_order_and_the_rest_stays() -> None:
    doc = {
        "passed": False,
        "reasons": [f"reason {i} " + "r" * 200 for i in range(40)],
        "stats": {f"guard:{i}": {"effect": 0.01 * i} for i in range(40)},
        "failed": [f"guard:{i}" for i in range(40)],
    }
    back = json.loads(tag := json_tag(doc, shrink=("reasons", "stats", "failed")))
    assert len(tag) <= TAG_MAX_CHARS and back["truncated"] is True
    # the first named field shrinks first, from its end; the later ones keep everything while that is enough
    assert back["reasons"] == doc["reasons"][: len(back["reasons"])] and 0 < len(back["reasons"]) < 40
    assert back["stats"] == doc["stats"] and back["failed"] == doc["failed"] and back["passed"] is False


def test_when_the_named_fields_are_not_enough_the_largest_other_fields_go() -> None:
    doc = {"count": 3, "blob": ["b" * 100] * 100, "note": "n" * 300, "last": "l" * 10}
    back = json.loads(tag := json_tag(doc, shrink=("last",)))
    assert len(tag) <= TAG_MAX_CHARS
    assert back == {"count": 3, "note": "n" * 300, "last": "", "truncated": True}


@pytest.mark.parametrize("limit", [20, 100, 1000])
def test_any_doc_becomes_valid_json_within_the_limit(limit: int) -> None:
    doc = {"a": "x" * 5000, "b": list(range(2000)), "c": {str(i): i for i in range(500)}, "d": None}
    tag = json_tag(doc, shrink=("b", "a", "c"), limit=limit)
    assert len(tag) <= limit and json.loads(tag)["truncated"] is True
