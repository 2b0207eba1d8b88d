"""benchmarks/catalog_scale.py at N = 10^4: the sweep covers every adapter and every figure is reported.

No timing assertions: speed is the benchmark's business; this checks that the path it measures works end to end
(pack writing, bulk registration, on-demand loads through the loader, the Zipf stream, the resident baseline).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 10,000 rows (21 s)
def test_catalog_scale_at_ten_thousand(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "catalog_scale.py"),
            "--adapters",
            "10000",
            "--resolves",
            "2000",
            "--requests",
            "512",
            "--warmup",
            "512",
            "--slots",
            "256",
            "--host-cache",
            "1024",
            "--out",
            str(tmp_path / "scale"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["adapters"] == 10_000 and result["sweep_covered"] == 10_000
    for key in (
        "resolve_p99_ms",
        "cold_load_p50_ms",
        "cold_load_p99_ms",
        "zipf_vs_resident",
        "disk_bytes",
        "peak_rss_bytes",
    ):
        assert isinstance(result[key], int | float) and result[key] > 0, key
    assert 0 < result["zipf_hit_rate"] < 1
    assert len(list((tmp_path / "scale" / "packs").glob("*.safetensors"))) == 3  # 4,096 per pack
