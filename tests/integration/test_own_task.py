"""A user's task through the whole lifecycle: examples/gsm8k-format (GSM8K's format, chat prompts, the user's
math-verify reward in a process pool, an lm-eval YAML with a regex filter) on a tiny Qwen2 chat base built here
(a BPE tokenizer trained locally, ChatML template): rollout -> GRPO update -> export -> lm-eval -> gate -> promote
-> served, on mint serve and on a real vLLM. No mint source file names the task: it is registered only through
$MINT_TASK_DIRS, as `mint run --tasks examples/gsm8k-format` registers it.

The base is random, so its completions earn no reward: the scores do not matter here, the path does. The dry run
(which would rightly refuse such a reward) is off, and the gate checks sample counts only (`compare=False`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow import MlflowClient

from flows.forms import PolicyRun, Training
from flows.lifecycle import lifecycle
from mint_core.data.spec import TASK_DIRS_ENV, registry
from mint_core.engine.base import build_tiny_chat_base
from mint_core.eval.gate import GatePolicy
from mint_core.eval.results import EvalConfig
from mint_core.eval.suites import standalone_suites
from mint_core.lifecycle.smoke import served_revision
from mint_core.lifecycle.workspace import Workspace
from mint_core.rl.grpo import GRPOConfig
from mint_core.rl.policy import PolicySpec
from mint_core.serving.vllm_process import vllm_available
from mint_testkit.harness import VLLM_PYTHON, free_port, start_front, start_server, start_vllm, stop_server
from mint_testkit.skips import require
from tests.fault_points import FAULT_ENV

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gsm8k-format"
ADMIN = "admin-secret"
GRPO = GRPOConfig(
    group_size=4, max_new_tokens=24, learning_rate=1e-2, weight_decay=0.5, drop_zero_variance=False
)


@dataclass
class Stack:
    ws: Workspace
    backend: str
    suites: Path  # the built-in suites with data built here (a clean clone has no DVC outputs)


# the vLLM case starts a vLLM of its own: slow tier (the default tier keeps one vLLM, the session's)
@pytest.fixture(scope="module", params=["mint", pytest.param("vllm", marks=pytest.mark.slow)])
def stack(
    request: pytest.FixtureRequest,
    mlflow_server: str,
    prefect_server: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp(f"own-task-{request.param}")
    base_dir = build_tiny_chat_base(root / "tiny-qwen2-chat", "qwen2")
    store = root / "store"
    store.mkdir()
    suites = standalone_suites(root, limit=6)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TASK_DIRS_ENV, str(EXAMPLE))  # the servers started below inherit it
        mp.setenv("MINT_SERVE_ADMIN_TOKEN", ADMIN)
        mp.delenv(FAULT_ENV, raising=False)
        procs = []
        try:
            if request.param == "vllm":
                require(vllm_available(VLLM_PYTHON), f"vLLM's environment {VLLM_PYTHON} (make vllm-venv)")
                vport, fport = free_port(), free_port()
                procs.append(start_vllm(base_dir, vport, f"http://127.0.0.1:{fport}", root / "vllm.log"))
                front, url = start_front(f"http://127.0.0.1:{vport}", store, base_dir, fport, None)
                procs.append(front)
            else:
                proc, url = start_server(
                    store, "--base", str(base_dir), env={"MINT_SERVE_TORCH_THREADS": "1"}
                )
                procs.append(proc)
            ws = Workspace(
                tracking_uri=mlflow_server,
                store=str(store),
                catalog_url=f"sqlite:///{root / 'catalog.db'}",
                base=base_dir,
                serving_url=url,
                admin_token_file=None,
                work_dir=root / "work",
                lock_hold_s=60,
            )
            yield Stack(ws, request.param, suites)
        finally:
            for p in reversed(procs):
                stop_server(p, timeout=60)


def test_the_gsm8k_format_example_runs_the_whole_lifecycle(stack: Stack) -> None:
    assert "gsm8k-format" in registry().names()
    name = f"gsm8k-{stack.backend}"
    policy = PolicyRun(
        spec=PolicySpec(name=name, task="gsm8k-format", rank=4, alpha=8),
        gate=GatePolicy(suite="gsm8k-format", guard_tasks=[], compare=False),
    )
    training = Training(
        steps=2, prompts_per_step=4, grpo=GRPO, data_dir=None, round=f"own-{stack.backend}", dry_run=0
    )
    report = lifecycle(
        policy=policy,
        training=training,
        evaluation=EvalConfig(limit=6, batch_size=8),
        workspace=stack.ws,
    )
    (outcome,) = report.outcomes
    assert outcome.status == "promoted", outcome
    # the gate read the task's own lm-eval suite, all 6 held-out items (asked through the chat template)
    assert outcome.scores["candidate"]["gsm8k-format"].n == 6, outcome.scores
    reg = stack.ws.registry()
    version = reg.alias_version(name, "champion")
    assert version is not None
    rev = reg.revision(name, version)
    # MLflow records what trained it: the task, its spec's and its reward's hashes
    tags = MlflowClient(stack.ws.tracking_uri).get_model_version(name, str(version)).tags
    spec = registry().get("gsm8k-format")
    assert tags["mint.task"] == "gsm8k-format"
    assert tags["mint.task_spec"] == spec.digest() and tags["mint.reward"] == spec.reward_digest()
    assert json.loads(tags["mint.gate"])["passed"] is True
    # served: the champion answers a held-out conversation through the chat route, as its own revision
    with stack.ws.client() as c:
        assert served_revision(c, name) == rev.digest.prefixed
        text, fingerprint = c.ask(name, spec.heldout_rows()[0].prompt, max_tokens=8, temperature=0.0)
    assert fingerprint is not None and fingerprint.removeprefix("sha256:") == rev.digest.hex
    assert isinstance(text, str)


def test_a_task_that_declares_no_gate_is_judged_on_its_own_suite_and_shown_the_rest(stack: Stack) -> None:
    """The default gate of a policy whose task declares no `gate:` section (no PolicyRun.gate): its own suite
    gates it, and every built-in task's suite is scored beside it and reported, never gating: in the decision,
    its tag, its artifact and the training run's `change.<suite>` metrics."""
    if stack.backend == "vllm":
        pytest.skip("the gate reads what either backend scores: the same on both")
    name = "gsm8k-default-gate"
    policy = PolicyRun(spec=PolicySpec(name=name, task="gsm8k-format", rank=4, alpha=8))
    assert policy.gate_policy().guards() == []
    training = Training(
        steps=2, prompts_per_step=4, grpo=GRPO, data_dir=None, round="default-gate", dry_run=0
    )
    report = lifecycle(
        policy=policy,
        training=training,
        evaluation=EvalConfig(limit=6, batch_size=8, suites_dir=stack.suites),
        workspace=stack.ws,
    )
    (outcome,) = report.outcomes
    assert outcome.decision is not None and outcome.decision.baseline == "base"
    gating = [c.name for c in outcome.decision.checks if c.gating]
    assert gating == ["samples:gsm8k-format", "gain:gsm8k-format"], gating
    builtins = ["add", "copy", "reverse", "sort", "upper"]
    info = {c.name: c for c in outcome.decision.side_effects()}
    assert sorted(info) == [f"info:{t}" for t in builtins]
    assert all(c.passed and c.stats is not None and c.stats.n == 6 for c in info.values())
    assert all(c.detail.endswith("(not a guard)") for c in info.values())
    assert any("(not a guard)" in r for r in outcome.reasons)
    # a random base gains nothing: rejected by its own suite alone, whatever the others did
    assert outcome.status == "rejected" and [c.name for c in outcome.decision.failed()] == [
        "gain:gsm8k-format"
    ]
    reg = stack.ws.registry()
    (rev,) = reg.revisions(name)
    tag = json.loads(rev.tags["mint.gate"])
    assert {f"info:{t}" for t in builtins} <= set(tag["stats"]) and tag["failed"] == ["gain:gsm8k-format"]
    assert rev.run_id is not None
    metrics = MlflowClient(stack.ws.tracking_uri).get_run(rev.run_id).data.metrics
    assert {f"change.{t}" for t in [*builtins, "gsm8k-format"]} <= set(metrics), sorted(metrics)


def _break_reward(d: Path) -> None:
    spec = yaml.safe_load((d / "task.yaml").read_text())
    spec["rewards"][0]["function"] = "reward.py:no_such_function"
    (d / "task.yaml").write_text(yaml.safe_dump(spec))


def _leak_heldout(d: Path) -> None:
    first = (d / "data" / "heldout.jsonl").read_text().splitlines()[0]
    with (d / "data" / "train.jsonl").open("a") as f:
        f.write(first.replace("heldout-0", "leaked") + "\n")


def _break_eval(d: Path) -> None:
    doc = yaml.safe_load((d / "eval.yaml").read_text())
    (d / "eval.yaml").write_text(yaml.safe_dump({**doc, "output_type": "generate_everything"}))


@pytest.mark.parametrize(
    ("case", "change", "message"),
    [
        ("reward does not import", _break_reward, "has no function 'no_such_function'"),
        ("held-out row in train", _leak_heldout, r"expect_column_values_to_be_unique\(column=prompt\)"),
        ("eval YAML lm-eval rejects", _break_eval, "lm-eval rejects eval 'gsm8k_format'"),
    ],
)
def test_a_broken_task_fails_before_anything_trains_and_changes_nothing(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, change: Any, message: str
) -> None:
    if stack.backend == "vllm":
        pytest.skip("validation runs before serving is touched: the same on both backends")
    broken = tmp_path / "gsm8k-broken"
    shutil.copytree(EXAMPLE, broken)
    spec = yaml.safe_load((broken / "task.yaml").read_text())
    (broken / "task.yaml").write_text(yaml.safe_dump({**spec, "name": "gsm8k-broken"}))
    change(broken)
    monkeypatch.setenv(TASK_DIRS_ENV, f"{EXAMPLE}:{broken}")
    name = "broken-" + case.replace(" ", "-").replace("-yaml-", "-")
    store = Path(stack.ws.store)
    stored_before = sorted(p.name for p in store.rglob("*"))
    with stack.ws.client() as c:
        served_before = sorted(m["id"] for m in c.models())
    policy = PolicyRun(
        spec=PolicySpec(name=name, task="gsm8k-broken", rank=4, alpha=8),
        gate=GatePolicy(suite="gsm8k-broken", guard_tasks=[], compare=False),
    )
    training = Training(steps=2, prompts_per_step=4, grpo=GRPO, data_dir=None, round="broken", dry_run=0)
    with pytest.raises(Exception, match=message):
        lifecycle(policy=policy, training=training, evaluation=EvalConfig(limit=6), workspace=stack.ws)
    # nothing was written anywhere: no registered model, no stored revision, nothing new served
    assert not MlflowClient(stack.ws.tracking_uri).search_registered_models(f"name = '{name}'")
    assert sorted(p.name for p in store.rglob("*")) == stored_before
    with stack.ws.client() as c:
        assert sorted(m["id"] for m in c.models()) == served_before
