"""The main job (`mint run`, what `make run` runs) end to end, in a temporary state directory on free ports:
servers started, two waves of the default policies on the built-in base (the first gated against the base), a served completion from every champion, a
rollback, where to look; then a second run that reuses the servers and the champions. Minutes: the `slow` tier.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import httpx
import pytest

from mint_app.services.config import SERVICES
from mint_testkit.harness import free_port, mint_cli
from mint_testkit.skips import require

# a fresh main job trains 300 steps per policy and evaluates 320-item suites: minutes, more beside other work
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
ROOT = Path(__file__).resolve().parents[2]
POLICIES = ["add", "sort"]


def mint(*args: str, timeout: float = 1200) -> subprocess.CompletedProcess[str]:
    # the job's server gets the admin token kept in its state dir, not one from the environment
    return mint_cli(*args, timeout=timeout, cwd=ROOT, unset=("MINT_SERVE_ADMIN_TOKEN",))


def test_main_job_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = (ROOT / "data" / "base" / "config.json").is_file() and (ROOT / "eval_suites" / "data").is_dir()
    require(built, "the built-in base and eval suites are not built (dvc repro)")
    state = tmp_path / "mint"
    ports = {"mlflow": free_port(), "prefect": free_port(), "serve": free_port()}
    # the worker's and the webhook receiver's ports: free ones too (environment: `mint run` has no flag for them)
    monkeypatch.setenv("MINT_RUN_WORKER_PORT", str(free_port()))
    monkeypatch.setenv("MINT_SERVICES_HOOKS_PORT", str(free_port()))
    # --no-build: the DVC step would rewrite the checkout's dvc.lock; the outputs are checked above
    flags = ["--state-dir", str(state), "--no-build", *(f"--{n}-port={p}" for n, p in ports.items())]
    serve = f"http://127.0.0.1:{ports['serve']}"
    try:
        first = mint("run", *flags)
        out = first.stdout
        assert first.returncode == 0, out[-6000:] + first.stderr[-4000:]

        # the servers were started, the policies had no champion: a first wave, then the wave
        assert out.count("started in") == len(SERVICES), out[:3000]
        assert "3a. wave: first revisions of add, sort" in out
        for p in POLICIES:
            assert re.search(rf"│ {p}\s+│ {p}/v1 .*│ promoted │ - -> {p}/v1", out), (p, out)
            assert re.search(rf"│ {p}\s+│ {p}/v2 .*│ (promoted|rejected) │", out), (p, out)

        # every first revision beat the bare base (revision 0) by the paired test, and the summary says by how much
        summary = json.loads(next(state.glob("runs/*/summary.json")).read_text())
        for p in POLICIES:
            first_wave = summary["policies"][p]["waves"]["first"]
            assert first_wave["compared_with"] == "base" and first_wave["gate_passed"], first_wave
            gain = next(c for c in first_wave["checks"] if c["check"] == f"gain:{p}")
            assert gain["n"] >= 200 and gain["p_value"] < 0.05 and gain["effect"] > 0, gain
        assert "base -> champion -> candidate" in out

        # a served completion from each policy's champion, answered by that revision
        served = out[out.index("served completions") :]
        for p in POLICIES:
            assert re.search(rf"│ {p}\s+│ {p}: .*│ {p}/v[12] [0-9a-f]{{8}}", served), (p, served)

        # canaries on live traffic: add's first revision promoted by the online test against the base, then add's
        # step-0 checkpoint rolled back against add's champion, each with its request count in the job's table
        canaries = out[out.index("canaries: the online test on live traffic") :]
        assert re.search(r"│ add/v1 \(first[^│]*│ base\s+│ promoted\s+│ [\d,]+\s+│ \+", canaries), canaries
        assert re.search(r"│ add/v\d+ \(step-0\)\s+│ v1\s+│ rolled back\s+│ [\d,]+\s+│ -", canaries), canaries
        assert re.search(r"add canary promoted after [\d,]+ requests", out)
        assert re.search(r"add/v\d+ rolled back after [\d,]+ requests", out)

        # a rollback of a policy the wave promoted, and a completion from the revision it restored; when the
        # statistical gate kept every champion (a second wave's gain is often within noise) there is none
        promoted = [p for p in POLICIES if re.search(rf"│ {p}\s+│ {p}/v2 .*│ promoted │", out)]
        m = re.search(r"rolled back (\w+)@champion: v(\d+) -> v(\d+)", out)
        if not promoted:
            assert m is None and "nothing to roll back" in out, out[-4000:]
            policy = None
        else:
            assert m, out[-4000:]
            policy, from_v, to_v = m.group(1), int(m.group(2)), int(m.group(3))
            assert policy in promoted and (from_v, to_v) == (2, 1)
            assert re.search(rf"answered by {policy}/v1 [0-9a-f]{{8}}", out)

        # timings and where to look
        assert re.search(r"│ total\s+│ \d+\.\d", out)
        assert f"http://127.0.0.1:{ports['prefect']}/runs/flow-run/" in out
        assert f"http://127.0.0.1:{ports['mlflow']}/#/models/add" in out
        assert f"{serve}/v1/models" in out and "The servers are still running" in out

        # the servers are still up, serving each policy's champion
        admin = {
            "Authorization": "Bearer " + (state / "run" / "serve.token").read_text().strip()
        }  # keys are on
        listed = httpx.get(serve + "/v1/models", headers=admin, trust_env=False)
        assert listed.status_code == 200, listed.text
        models = {m["id"]: m for m in listed.json()["data"]}
        assert set(POLICIES) <= set(models)
        catalog = f"sqlite:///{state / 'catalog.db'}"
        if policy is not None:
            history = mint("registry", "history", policy, "--catalog", catalog, timeout=120)
            assert history.returncode == 0 and "main job shows a rollback" in history.stdout, history.stdout

        # again: the servers and the champions are reused, so no first wave
        again = mint("run", *flags, "--steps", "2")
        assert again.returncode == 0, again.stdout[-6000:] + again.stderr[-4000:]
        assert again.stdout.count("already running") == len(SERVICES)
        assert "first revisions" not in again.stdout
        assert "3b. wave: add, sort trained from their champions" in again.stdout
    finally:
        down = mint("down", "--state-dir", str(state / "run"), timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
    with pytest.raises(httpx.HTTPError):
        httpx.get(serve + "/health", trust_env=False, timeout=2)
