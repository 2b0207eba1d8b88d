"""Issue 28, item 5: a retrain that keeps paying, or says why not.

The plateau rule of early stopping (when a policy stops, whether it gained), the fresh draw of training prompts
(no held-out or eval-suite prompt, nor a probe item, ever drawn; the same round draws the same prompts, another
round others), the probe log a resumed run reads back, and retrain's defaults and per-policy report.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from flows.forms import PolicyOutcome, Training
from flows.retrain import (
    RETRAIN_TRAINING,
    PolicyReport,
    Skipped,
    no_gain_waves,
    policy_reports,
    rejected_in_a_row,
    report_markdown,
)
from mint_core.data.build import write_task_data
from mint_core.data.checks import PromptBounds
from mint_core.data.generators import Example, read_jsonl
from mint_core.data.revision import evaluated_prompts, fresh_examples, probe_examples, train_prompts
from mint_core.eval.early_stop import EarlyStop, Plateau, Probe, ProbeLog, probe_gain
from mint_core.eval.gate import GATE_TAG
from mint_core.eval.suites import build_suite_data
from mint_core.lifecycle.prompts import round_seed
from mint_core.rl.policy import PolicySpec
from tasks.registry import NO_GAIN_TAG
from tasks.training import validate_data

ROOT = Path(__file__).resolve().parents[2]

# ---- the plateau rule -----------------------------------------------------------------------------------------


def feed(rule: Plateau, scores: list[float], every: int = 10) -> int | None:
    """Probe scores at steps 0, every, 2 x every, ...; the step the rule stopped at (None: never)."""
    for i, score in enumerate(scores):
        if rule.add(i * every, score):
            return i * every
    return None


@pytest.mark.parametrize(
    ("case", "scores", "stops_at", "gained", "reason"),
    [
        ("rises then flat", [0.50, 0.55, 0.60, 0.60, 0.61, 0.59, 0.70], 50, True, "plateau"),
        ("never rises", [0.50, 0.50, 0.51, 0.49, 0.80], 30, False, "no gain"),
        ("keeps rising", [0.50, 0.52, 0.54, 0.56, 0.58], None, True, "finished"),
        ("a rise resets the wait", [0.5, 0.5, 0.5, 0.52, 0.52, 0.52, 0.52], 60, True, "plateau"),
        ("falls", [0.60, 0.55, 0.50, 0.45], 30, False, "no gain"),
    ],
)
def test_plateau_stops_after_patience_probes_without_a_rise(
    case: str, scores: list[float], stops_at: int | None, gained: bool, reason: str
) -> None:
    rule = Plateau(min_delta=0.015, patience=3, stop_after_gain=True)
    assert feed(rule, scores) == stops_at, case
    assert rule.stopped_at == stops_at
    assert rule.gained is gained, case
    assert rule.reason(100).startswith(reason + ":"), rule.reason(100)


def test_by_default_only_a_policy_without_gain_stops() -> None:
    """A policy that rose trains to its last step (the decaying rate consolidates late); one that never rose
    over its step-0 probe stops after `patience` probes, with the learning curves' dip of a restarted rate."""
    risen = Plateau.of(EarlyStop(min_delta=0.025, patience=3))
    assert feed(risen, [0.40, 0.50, 0.51, 0.45, 0.46, 0.43, 0.46, 0.52]) is None
    assert risen.gained and risen.reason(70).startswith("finished: all 70 steps")
    dipped = Plateau.of(EarlyStop(min_delta=0.025, patience=3))  # a champion's wave: its probe first dips
    assert feed(dipped, [0.5625, 0.4609, 0.4609, 0.5312, 0.5625]) == 30
    assert not dipped.gained and dipped.reason(100).startswith("no gain: probe 0.562 at step 0")
    late = Plateau.of(EarlyStop(min_delta=0.025, patience=3))  # a rise within patience keeps it going
    assert feed(late, [0.117, 0.109, 0.117, 0.188, 0.18, 0.17, 0.17, 0.17]) is None
    assert (
        Plateau.of(EarlyStop(), rejected=2).patience == 1
        and Plateau.of(EarlyStop(), rejected=1).patience == 3
    )


def test_a_champion_with_headroom_is_not_stopped_for_its_dip() -> None:
    """A continuation whose champion has headroom keeps training through the dip of a restarted AdamW (its
    probe rises after about 100 steps: docs/training.md), even after rejections; only a fall well beyond noise
    (`room_fall_p`) stops it."""
    shout = [0.4922, 0.5, 0.5, 0.4688, 0.4844, 0.5156, 0.5156, 0.5547, 0.5859]  # measured, every 10 steps
    assert feed(Plateau.of(EarlyStop(), room=True), shout) is None
    assert feed(Plateau.of(EarlyStop(), room=False), shout) == 30  # a saturated champion's rule
    assert Plateau.of(EarlyStop(), rejected=2, room=True).patience > 20  # its dip says nothing of its past
    assert Plateau.of(EarlyStop(), rejected=2, room=False).patience == 1
    start = [True] * 64 + [False] * 64
    roomy = Plateau.of(EarlyStop(fall_p=0.05), room=True)
    roomy.add(0, 0.5, start)
    assert roomy.add(10, 52 / 128, [True] * 52 + [False] * 76) and roomy.fell is not None


def test_a_probe_that_falls_below_its_start_beyond_noise_stops_at_once() -> None:
    """A continuation whose probe falls below its champion's (paired, McNemar p < fall_p) stops at that probe,
    even after a rise, and is not exported; a fall within noise does not stop it."""
    start = [True] * 64 + [False] * 64
    rule = Plateau.of(EarlyStop(fall_p=0.05))
    rule.add(0, 0.5, start)
    noisy = [True] * 61 + [False] * 67  # 3 items lost: p 0.25
    assert not rule.add(10, 61 / 128, noisy) and rule.fell is None and rule.exportable
    fallen = [True] * 52 + [False] * 76  # 12 lost: p 5e-4
    assert rule.add(20, 52 / 128, fallen) and rule.stopped_at == 20
    assert not rule.exportable and rule.fell is not None and rule.fell[1] < 0.05
    assert rule.reason(100).startswith("fell: probe 0.500 at step 0, 0.406 at step 20 (-0.094, p ")
    risen = Plateau.of(EarlyStop(fall_p=0.05))
    risen.add(0, 0.5, start)
    risen.add(10, 0.6, [True] * 77 + [False] * 51)
    assert risen.gained and risen.add(20, 52 / 128, fallen) and not risen.exportable
    scores_only = Plateau.of(EarlyStop(fall_p=0.05))  # without items, only the plateau rule
    assert not scores_only.add(0, 0.5) and not scores_only.add(10, 0.3)


def test_a_rise_must_reach_min_delta_over_the_best_so_far() -> None:
    rule = Plateau(min_delta=0.02, patience=2, stop_after_gain=True)
    rule.add(0, 0.50)
    rule.add(10, 0.515)  # +0.015 < 0.02: not a rise, and the best stays 0.50
    assert rule.best is not None and (rule.best.step, rule.waited) == (0, 1)
    rule.add(20, 0.52)  # exactly min_delta over the best: a rise
    assert rule.best.step == 20 and rule.waited == 0 and rule.gained
    # small steps that never beat the best by min_delta do not add up to a rise
    assert not rule.add(30, 0.535) and rule.add(40, 0.535)
    assert rule.stopped_at == 40 and rule.best.step == 20


def test_with_min_delta_zero_an_equal_score_is_no_rise() -> None:
    rule = Plateau(min_delta=0.0, patience=2)
    assert feed(rule, [0.0, 0.0, 0.0, 0.0]) == 20  # a base that scores nothing stops, without gain
    assert not rule.gained and rule.reason(8).startswith("no gain:")


def test_no_probe_after_the_stop_and_the_reason_names_the_numbers() -> None:
    rule = Plateau(min_delta=0.01, patience=1)
    assert feed(rule, [0.40, 0.40]) == 10
    with pytest.raises(ValueError, match="stopped at step 10"):
        rule.add(20, 0.9)
    why = rule.reason(100)
    assert "probe 0.400 at step 0" in why and "no rise of 0.01 in 1 probe(s) to step 10" in why
    assert Plateau(0.01, 3).reason(100) == "finished: all 100 steps (not probed)"


def test_rejected_policies_get_one_probe() -> None:
    stop = EarlyStop(patience=4, after_rejections=2)
    assert [stop.patience_for(n) for n in (0, 1, 2, 5)] == [4, 4, 1, 1]


@pytest.mark.parametrize(
    ("field", "value"), [("every", 0), ("patience", 0), ("min_delta", -0.1), ("probe_items", 4)]
)
def test_early_stop_refuses_nonsense(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        EarlyStop.model_validate({field: value})


def test_probe_gain_is_paired() -> None:
    first = [True, False, False, True, False]
    last = [True, True, True, True, False]
    gain, p = probe_gain(first, last)
    assert gain == pytest.approx(2 / 5) and p == pytest.approx(
        0.5
    )  # 2 gained, 0 lost: exact McNemar 2 x 0.5^2


# ---- fresh draws ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Task data as the DVC `task_data` stage lays it out, with eval suites built from it under `suites/`."""
    root = tmp_path_factory.mktemp("tasks")
    write_task_data(root / "tasks", ["add", "sort", "reverse"], n_train=300, n_heldout=60, seed=0)
    build_suite_data(root / "suites", tasks_dir=root / "tasks", limit=40, guard_limit=6)
    return root


def test_evaluated_prompts_are_the_held_out_split_and_the_suites(data: Path) -> None:
    got = evaluated_prompts(data / "tasks", data / "suites")
    heldout = {
        e.prompt
        for t in ("add", "sort", "reverse")
        for e in read_jsonl(data / "tasks/heldout" / f"{t}.jsonl")
    }
    suites = {json.loads(line)["prompt"] for f in (data / "suites").glob("*.jsonl") for line in f.open()}
    assert got == heldout | suites and len(heldout) == 180
    assert evaluated_prompts(data / "tasks", data / "no-such-dir") == heldout  # missing suites: nothing more


def test_no_evaluated_prompt_leaks_into_a_fresh_draw_or_the_probe(data: Path) -> None:
    evaluated = evaluated_prompts(data / "tasks", data / "suites")
    for task in ("add", "sort", "reverse"):
        train = train_prompts(data / "tasks", task)
        probe = probe_examples(task, 64, evaluated | train)
        fresh = fresh_examples(task, 2000, seed=12345, exclude=evaluated | {e.prompt for e in probe})
        drawn = {e.prompt for e in fresh}
        assert len(drawn) == 2000 and all(e.task == task for e in fresh)
        assert not drawn & evaluated, task
        assert not drawn & {e.prompt for e in probe}, task
        assert not {e.prompt for e in probe} & (evaluated | train), task


def test_a_crowded_task_still_leaks_nothing() -> None:
    """`add` has 10^4 prompts: excluding a third of them, a draw of a third more never returns one."""
    every = {f"add: {a}+{b} =" for a in range(100) for b in range(100)}
    excluded = set(sorted(every)[::3])
    fresh = fresh_examples("add", 3000, seed=7, exclude=excluded)
    assert not {e.prompt for e in fresh} & excluded
    with pytest.raises(ValueError, match="cannot draw 9000 fresh add prompts"):
        fresh_examples("add", 9000, seed=7, exclude=excluded)


def test_the_same_round_draws_the_same_prompts_and_another_round_others(data: Path) -> None:
    spec = PolicySpec(name="p", task="add")

    def draw(round_name: str) -> Any:
        return validate_data.fn(
            spec, 64, 0, data / "tasks", PromptBounds(), round_name, True, data / "suites", 32
        )

    monday, again, tuesday = draw("2025-01-06"), draw("2025-01-06"), draw("2025-01-07")
    assert monday.examples == again.examples and monday.probe == again.probe
    assert monday.fresh_seed == round_seed(0, "2025-01-06") and tuesday.fresh_seed == round_seed(
        0, "2025-01-07"
    )
    assert monday.source == f"fresh:add:seed={monday.fresh_seed}"
    overlap = {e.prompt for e in monday.examples} & {e.prompt for e in tuesday.examples}
    assert len(overlap) < 8, overlap  # 64 of ~9,800 prompts each: a few in common by chance at most
    assert monday.probe == tuesday.probe  # the probe is fixed, so rounds are comparable
    evaluated = evaluated_prompts(data / "tasks", data / "suites")
    for ps in (monday, tuesday):
        assert not {e.prompt for e in ps.examples} & (evaluated | {e.prompt for e in ps.probe})


def test_the_train_draw_is_unchanged_and_a_fresh_draw_needs_the_held_out_data(data: Path) -> None:
    spec = PolicySpec(name="p", task="sort")
    train = validate_data.fn(spec, 16, 0, data / "tasks", PromptBounds(), "r1")
    assert train.fresh_seed is None and train.probe == [] and train.source.endswith("sort.jsonl#round=r1")
    pool = {e.prompt for e in read_jsonl(data / "tasks/train/sort.jsonl")}
    assert {e.prompt for e in train.examples} <= pool
    with pytest.raises(Exception, match="need data_dir"):
        validate_data.fn(spec, 16, 0, None, PromptBounds(), "r1", True)


# ---- the probe log a resumed run reads back -------------------------------------------------------------------


def test_probe_log_keeps_the_probes_up_to_the_checkpoint_and_only_for_its_items(tmp_path: Path) -> None:
    items = {"a": [Example("a-0", "add", "add: 1+2 =", "3")]}
    path = tmp_path / "probes.json"
    log = ProbeLog.read(path, items, upto=0)
    assert log.probes == []
    for step in (0, 10, 20):
        log.probes.append(Probe(step=step, correct={"a": [step >= 10]}))
    log.write(path)
    assert [p.step for p in ProbeLog.read(path, items, upto=10).probes] == [0, 10]
    other = {"a": [Example("a-1", "add", "add: 2+2 =", "4")]}
    assert ProbeLog.read(path, other, upto=20).probes == []


# ---- retrain: defaults, history, report -----------------------------------------------------------------------


def test_retrain_trains_on_fresh_prompts_with_early_stopping_by_default() -> None:
    assert RETRAIN_TRAINING.draw == "fresh" and RETRAIN_TRAINING.early_stop == EarlyStop()
    deployments = yaml.safe_load((ROOT / "infra" / "prefect.yaml").read_text())["deployments"]
    form = next(d for d in deployments if d["name"] == "retrain")["parameters"]
    assert Training.model_validate(form["training"]) == RETRAIN_TRAINING


def test_the_key_round_names_the_draw_and_early_stop_only_when_set() -> None:
    plain = Training(round="r")
    assert plain.key_round() == "r"  # as before: existing runs' idempotency keys do not move
    fresh = Training(round="r", draw="fresh")
    assert fresh.key_round() == "r|draw=fresh"
    stopped = Training(round="r", draw="fresh", early_stop=EarlyStop())
    assert (
        stopped.key_round().startswith("r|draw=fresh|early_stop=")
        and stopped.key_round() != fresh.key_round()
    )


def _rev(version: int, passed: bool | None) -> SimpleNamespace:
    tags = {} if passed is None else {GATE_TAG: json.dumps({"passed": passed, "reasons": []})}
    return SimpleNamespace(version=version, tags=tags)


@pytest.mark.parametrize(
    ("case", "versions", "champion", "expected"),
    [
        ("none since the champion", [(1, True), (2, True)], 2, 0),
        ("two rejected", [(1, True), (2, False), (3, False)], 1, 2),
        (
            "an ungated attempt neither counts nor breaks",
            [(1, True), (2, False), (3, None), (4, False)],
            1,
            2,
        ),
        ("a passed one after a rollback ends the count", [(1, True), (2, True), (3, False)], 1, 1),
        ("older than the champion does not count", [(1, False), (2, False), (3, True)], 3, 0),
    ],
)
def test_rejected_in_a_row(
    case: str, versions: list[tuple[int, bool | None]], champion: int, expected: int
) -> None:
    reg = SimpleNamespace(revisions=lambda policy: [_rev(v, p) for v, p in versions])
    assert rejected_in_a_row(reg, "p", SimpleNamespace(version=champion)) == expected, case  # type: ignore[arg-type]


def test_waves_stopped_without_gain_count_as_failed_attempts() -> None:
    """A wave that early stopping ended without a gain makes no version; the champion's `mint.no_gain` tag
    counts it, and a malformed tag counts nothing."""
    champ = SimpleNamespace(tags={NO_GAIN_TAG: json.dumps({"count": 2, "last": "no gain: ..."})})
    assert no_gain_waves(champ) == 2  # type: ignore[arg-type]
    assert no_gain_waves(SimpleNamespace(tags={})) == 0  # type: ignore[arg-type]
    assert no_gain_waves(SimpleNamespace(tags={NO_GAIN_TAG: "not json"})) == 0  # type: ignore[arg-type]


def test_the_report_says_per_policy_gain_p_steps_and_why() -> None:
    stopped = PolicyOutcome(
        policy="sort",
        status="stopped",
        candidate=None,
        champion_before="sort/v3",
        champion_after="sort/v3",
        gain=0.0,
        p_value=1.0,
        gain_on="probe",
        steps=10,
        stop_reason="its last 2 candidates were rejected, so one probe to show a gain: no gain: ...",
    )
    promoted = PolicyOutcome(
        policy="add",
        status="promoted",
        candidate="add/v5",
        champion_before="add/v4",
        champion_after="add/v5",
        gain=0.0625,
        p_value=0.0012,
        gain_on="suite:add",
        steps=60,
        stop_reason="plateau: probe ...",
    )
    wave = SimpleNamespace(outcomes=[promoted, stopped])
    runs = [SimpleNamespace(name="add", rejected=0), SimpleNamespace(name="sort", rejected=2)]
    rows = policy_reports(runs, [Skipped(policy="copy", reason="no champion")], wave)  # type: ignore[arg-type]
    assert [(r.policy, r.status, r.steps, r.rejected_before) for r in rows] == [
        ("add", "promoted", 60, 0),
        ("sort", "stopped", 10, 2),
        ("copy", "skipped", None, 0),
    ]
    md = report_markdown(rows)
    assert "| add | promoted | +0.062 | 0.0012 | suite:add | 60 | 0 | plateau: probe ... |" in md
    assert "| copy | skipped | - | - | - | - | 0 | no champion |" in md
    assert promoted.summary()["gain"] == 0.0625 and promoted.summary()["stop_reason"] == "plateau: probe ..."
    assert (
        report_markdown([]).startswith("### Retrain")
        and PolicyReport(policy="x", status="skipped").steps is None
    )
