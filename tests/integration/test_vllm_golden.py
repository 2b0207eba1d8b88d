"""The golden probe (mint_core/serving/golden.py, issue #34 item 0).

On the session's vLLM: beside mixed traffic it records the base's and a champion's answers and raises no false
alarm (a false one would kill the session's vLLM). End to end, the fault suite's `poison` row alone: a sealed,
supervised vLLM behind mint's front (as `mint up --serving vllm` starts them) refuses issue #34's unkeyed attack; a
NaN adapter forced in with mint's key is noticed by the golden probe, the replica is taken out of rotation with the
evidence logged and restarted by its supervisor, and every answer after it comes back is the one before the
attack. Minutes (two vLLM starts): the slow tier."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from mint_core.engine.base import load_base
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_core.serving.vllm_process import vllm_available
from mint_testkit.harness import VLLM_PYTHON, free_port, server_log, start_front, stop_server
from mint_testkit.skips import require
from tests.integration.conftest import VLLMServer

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
ADMIN = {"Authorization": "Bearer admin-secret"}  # conftest.start_server's admin token


def metric(text: str, series: str) -> float | None:
    """The value of one series (name and labels, as Prometheus prints them) in a /metrics page."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


def test_the_probe_records_the_base_and_a_champion_and_keeps_quiet_beside_traffic(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    server = vllm_server
    base = load_base(server.base_dir)
    save_adapter(
        random_adapter(
            base.sites, ["q_proj", "v_proj"], 8, seed=21, std=0.3, base_fingerprint=base.fingerprint
        ),
        server.store / "golden-champ",
        base.sites,
    )
    proc, url = start_front(
        server.vllm_url, server.store, server.base_dir, free_port(), None, golden_interval_s=1
    )
    try:
        with httpx.Client(base_url=url, timeout=120) as h:
            r = h.post(
                "/v1/load_lora_adapter",
                json={"lora_name": "golden-champ", "lora_path": "golden-champ"},
                headers=ADMIN,
            )
            assert r.status_code == 200, r.text
            stop = threading.Event()
            codes: list[int] = []

            def traffic(model: str) -> None:
                while not stop.is_set():
                    body = {"model": model, "prompt": "Once upon", "max_tokens": 16, "temperature": 0.7}
                    codes.append(h.post("/v1/completions", json=body).status_code)

            threads = [
                threading.Thread(target=traffic, args=(m,)) for m in (server.base_dir.name, "golden-champ")
            ]
            for th in threads:
                th.start()
            try:
                deadline = time.monotonic() + 90
                while (metric(h.get("/metrics").text, 'mint_golden_probes_total{outcome="pass"}') or 0) < 5:
                    assert time.monotonic() < deadline, h.get("/metrics").text[-3000:]
                    time.sleep(0.5)
            finally:
                stop.set()
                for th in threads:
                    th.join(120)
            text = h.get("/metrics").text
            assert metric(text, 'mint_golden_recorded{of="base"}') == 3, text
            assert metric(text, 'mint_golden_recorded{of="champion golden-champ"}') == 3, text
            assert metric(text, 'mint_golden_probes_total{outcome="fail"}') is None, text
            assert metric(text, "mint_replica_in_rotation") == 1, text
            assert codes and set(codes) == {200}, codes
            assert h.get("/health").status_code == 200
            r = h.post("/v1/unload_lora_adapter", json={"lora_name": "golden-champ"}, headers=ADMIN)
            assert r.status_code == 200, r.text
    finally:
        stop_server(proc)
    assert "golden evidence" not in server_log(proc)


@pytest.mark.slow
@pytest.mark.faults
@pytest.mark.timeout(1800)
def test_a_poisoned_vllm_is_noticed_taken_out_and_comes_back_clean(tmp_path: Path) -> None:
    require(vllm_available(VLLM_PYTHON), f"vLLM's environment {VLLM_PYTHON} (make vllm-venv)")
    out = tmp_path / "poison.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "faults.py"), "--only", "poison", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert out.is_file(), run.stdout[-3000:] + run.stderr[-5000:]
    (row,) = json.loads(out.read_text())
    assert row["ok"] and row["lost"] == 0, (row, run.stderr[-5000:])
    result = row["result"]
    assert "unkeyed POST /adapters 401, POST /v1/load_lora_adapter 401" in result, result
    assert (
        "(0 after detection)" in result and "back clean: True" in result and "evidence logged: True" in result
    )
