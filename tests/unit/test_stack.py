"""How a flow command picks its servers (`mint_app.services.stack`): what the user gave wins (a --params field, an exported
variable), the running stack fills the rest; with nothing running, nothing is filled in."""

from __future__ import annotations

from pathlib import Path

import pytest

from mint_app.services.config import ServicesConfig
from mint_app.services.stack import Stack, find_stack, flow_run_url, flow_workspace

STACK = Stack(
    Path(".mint/run"),
    prefect="http://127.0.0.1:4300",
    mlflow="http://127.0.0.1:5100",
    serve="http://127.0.0.1:8100",
    workspace={"tracking_uri": "http://127.0.0.1:5100", "serving_url": "http://127.0.0.1:8100"},
)


def test_given_fields_win_and_the_stack_fills_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    got = flow_workspace(STACK, {"serving_url": "http://elsewhere:8000", "store": "s3://bucket/store"})
    assert got == {
        "serving_url": "http://elsewhere:8000",
        "store": "s3://bucket/store",
        "tracking_uri": "http://127.0.0.1:5100",
    }


def test_an_exported_tracking_uri_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mine:5000")
    assert "tracking_uri" not in flow_workspace(STACK, None)  # the flow's Workspace reads the variable itself


def test_nothing_running_fills_nothing(tmp_path: Path) -> None:
    stack = find_stack(ServicesConfig(state_dir=tmp_path / "run"))
    assert (stack.prefect, stack.mlflow, stack.serve, stack.workspace) == (None, None, None, {})
    assert flow_workspace(stack, {"base": "b"}) == {"base": "b"}


def test_flow_run_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert flow_run_url(STACK, "f00") == "http://127.0.0.1:4300/runs/flow-run/f00"
    monkeypatch.setenv("PREFECT_API_URL", "http://other:4200/api")
    assert flow_run_url(STACK, "f00") == "http://other:4200/runs/flow-run/f00"
