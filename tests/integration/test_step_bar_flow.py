"""A GRPO step's record keeps its numbers through Prefect's run logger (the wave flow logs them with `extra`), so
the main job's console draws its bar from them, while the flow run's log on the server keeps every step's line."""

from __future__ import annotations

import io
import logging
import os
import time

import httpx
import pytest
from prefect import flow, get_run_logger
from rich.console import Console

from flows.lifecycle import STEP_RECORD
from mint_app.job.progress import step_bar
from mint_app.services.prefect_auth import auth_header

pytestmark = pytest.mark.integration


@flow(name="steps")
def steps_flow(n: int) -> None:
    log = get_run_logger()
    for step in range(1, n + 1):  # as flows.lifecycle.train logs each step
        reward = {"add": step / n}
        log.info(
            "step %d/%d: reward %s",
            step,
            n,
            reward,
            extra={STEP_RECORD: {"step": step, "steps": n, "reward": reward}},
        )


def test_step_records_move_the_bar_and_stay_in_the_run_log(prefect_server: str) -> None:
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    root = logging.getLogger()
    root.addHandler(handler)
    out = io.StringIO()
    try:
        with step_bar(Console(file=out, width=400), "GRPO add"):
            state = steps_flow(8, return_state=True)
    finally:
        root.removeHandler(handler)
    assert "step 3/8" not in buf.getvalue()  # no line per step on the console
    assert [line.split(" · ")[0] for line in out.getvalue().splitlines()] == [
        f"  GRPO add: step {s}/8" for s in (2, 4, 6, 8)
    ]
    run_id = str(state.state_details.flow_run_id)
    for _ in range(40):  # the API log handler sends in batches
        logs = httpx.post(
            f"{prefect_server}/logs/filter",
            json={"logs": {"flow_run_id": {"any_": [run_id]}}},
            headers=auth_header(os.environ.get("PREFECT_API_AUTH_STRING")),  # the session server's string
            timeout=10,
        ).json()
        messages = [entry["message"] for entry in logs]
        if sum(m.startswith("step ") for m in messages) == 8:
            break
        time.sleep(0.5)
    assert sum(m.startswith("step ") for m in messages) == 8, messages
