"""The canary split's routing and scores (serving/canary.py), without a server."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from mint_core.data.generators import GENERATORS, example_of, examples, take
from mint_core.data.rewards import Rewarder
from mint_core.serving.canary import (
    AlreadyScored,
    CanaryState,
    Collected,
    Split,
    UnknownResponse,
    bucket,
    task_score,
)


def test_a_key_lands_on_one_arm_and_the_share_holds() -> None:
    state = CanaryState()
    state.put("p", Split(canary="p@canary", control="p", share=0.2))
    arms = [state.route("p", f"user-{i}")[1] for i in range(20_000)]
    assert abs(arms.count("canary") / len(arms) - 0.2) < 0.01  # 0.01 is over 3.5 standard errors
    assert all(state.route("p", f"user-{i}")[1] == arms[i] for i in range(0, 20_000, 97))
    assert state.route("other", "user-1") == ("other", "none")
    # another policy splits the same users independently
    other = [bucket("q", f"user-{i}") < 0.2 for i in range(20_000)]
    both = sum(a == "canary" and o for a, o in zip(arms, other, strict=True))
    assert abs(both / 20_000 - 0.04) < 0.006


def test_counts_restart_with_a_new_candidate_and_repeating_a_put_changes_nothing() -> None:
    state = CanaryState()
    split = Split(canary="p@canary", control="p", share=0.5)
    assert state.put("p", split) and not state.put("p", split)
    state.answered("r1", "p", "canary", "p@canary", "aa", 1.0)
    assert state.view("p").arms["canary"].scored == 1
    state.put("p", Split(canary="p@canary2", control="p", share=0.5))
    view = state.view("p")
    assert view.arms == {} and len(view.events) == 1  # events stay readable in order
    assert state.clear("p") is not None and state.clear("p") is None


def test_feedback_scores_an_answer_once() -> None:
    state = CanaryState()
    state.answered("r1", "p", "control", "p", "bb", None)
    assert state.view("p").events == []
    e = state.feedback("r1", 0.25)
    assert (e.arm, e.revision, e.score, e.source) == ("control", "bb", 0.25, "feedback")
    with pytest.raises(AlreadyScored):
        state.feedback("r1", 1.0)
    with pytest.raises(UnknownResponse):
        state.feedback("nosuch", 1.0)
    state.answered("r2", "p", "control", "p", "bb", 1.0)  # scored by the task already
    with pytest.raises(AlreadyScored):
        state.feedback("r2", 0.0)


def test_a_reader_reads_on_from_its_cursor() -> None:
    state = CanaryState()
    for i in range(5):
        state.answered(f"r{i}", "p", "canary", "p@canary", "aa", float(i % 2))
    first = state.view("p", after=0, limit=3)
    assert [e.seq for e in first.events] == [1, 2, 3] and first.next == 3
    rest = state.view("p", after=first.next)
    assert [e.seq for e in rest.events] == [4, 5] and rest.next == 5
    assert state.view("p", after=2**62).next == 5  # a cursor past the end comes back to the end
    assert not rest.missed


@pytest.mark.parametrize(
    "split, field",
    [
        ({"canary": "c", "control": "p", "share": 0.0}, "share"),
        ({"canary": "c", "control": "p", "share": 1.0}, "share"),
        ({"canary": "", "control": "p", "share": 0.5}, "canary"),
        ({"control": "p", "share": 0.5}, "canary"),
    ],
)
def test_a_bad_split_names_its_field(split: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        Split.model_validate(split)


def test_every_task_prompt_is_scored_by_its_own_reward() -> None:
    rewarder = Rewarder()
    for t in GENERATORS:  # the built-in specs: 0.8 for the exact answer, 0.2 for an answer of the right shape
        for ex in take(examples(t, 5), 50):
            assert task_score(rewarder, ex.prompt, [f" {ex.answer}"]) == pytest.approx(1.0)
            assert task_score(rewarder, ex.prompt, ["no pe"]) == 0.0
            assert task_score(rewarder, ex.prompt, [ex.answer, "no pe"]) == pytest.approx(0.5)
    for not_a_task in ("Once upon a time", "add: 1+2", "add: a+b =", "sum: 1+2 =", "sort: 12 34 ="):
        assert example_of(not_a_task) is None and task_score(rewarder, not_a_task, ["3"]) is None


def test_answers_are_read_off_whole_and_streamed_responses() -> None:
    whole = Collected(stream=False)
    doc = {"id": "cmpl-1", "model": "p", "system_fingerprint": "aa", "choices": [{"index": 0, "text": " 42"}]}
    body = json.dumps(doc).encode()
    whole.feed(body[:10])
    whole.feed(body[10:])
    whole.finish()
    assert (whole.id, whole.fingerprint, whole.texts) == ("cmpl-1", "aa", {0: " 42"})

    stream = Collected(stream=True)
    chunks = [
        {
            "id": "chat-1",
            "model": "p",
            "system_fingerprint": "bb",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        },
        {"id": "chat-1", "choices": [{"index": 0, "delta": {"content": " 4"}}]},
        {"id": "chat-1", "choices": [{"index": 0, "delta": {"content": "2"}, "finish_reason": "stop"}]},
    ]
    raw = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    for i in range(0, len(raw), 7):  # events split anywhere across the body's messages
        stream.feed(raw[i : i + 7].encode())
    stream.finish()
    assert (stream.id, stream.fingerprint, stream.texts) == ("chat-1", "bb", {0: " 42"})
