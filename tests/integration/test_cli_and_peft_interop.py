"""End to end through the `mint` command and real files on disk: a base written as a Hugging Face directory,
adapters made by PEFT itself (as a user's training job would), inspected, converted and served by mint."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from mint_core.engine.base import load_base
from mint_core.engine.engine import Engine, EngineConfig
from mint_testkit.harness import cli_env, mint_cli

pytestmark = pytest.mark.integration


def mint(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return mint_cli(*args, check=check)


def peft_adapter(base_dir: Path, out: Path, config: LoraConfig, seed: int) -> None:
    """An adapter saved by PEFT's own save_pretrained, with lora_B randomised (PEFT initialises it to zero)."""
    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(out)


@pytest.mark.parametrize(
    ("family", "config"),
    [
        ("dense", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])),
        pytest.param(
            "moe",
            LoraConfig(
                r=2,
                lora_alpha=4,
                target_modules=["q_proj", "o_proj"],
                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            ),
            marks=pytest.mark.slow,  # 16 s; PEFT and the packed MoE layout: also tests/unit/test_adapter_format.py
        ),
    ],
)
def test_peft_saved_adapter_is_served_by_mint(tmp_path, family, config):
    base_dir = tmp_path / "base"
    out = mint("base", "build-tiny", str(base_dir), "--family", family)
    assert "fingerprint" in out.stdout
    peft_adapter(base_dir, tmp_path / "a", config, seed=0)

    inspected = mint("adapter", "inspect", str(tmp_path / "a"), "--base", str(base_dir))
    assert "digest sha256:" in inspected.stdout

    engine = Engine(load_base(base_dir), EngineConfig(max_loras=2, max_lora_rank=8, allowed_roots=[tmp_path]))
    engine.load_adapter("a", tmp_path / "a")
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    got = engine.logits(ids, ["a", None])

    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "a")
    with torch.no_grad():
        want = reference(input_ids=ids[:1]).logits
        bare = AutoModelForCausalLM.from_pretrained(base_dir)(input_ids=ids[1:]).logits
    assert ((got[:1] - want).abs().max() / want.abs().max()) < 1e-4
    assert ((got[1:] - bare).abs().max() / bare.abs().max()) < 1e-4
    assert (want - bare[:1]).abs().max() > 1e-3  # the adapter really changes the output

    if family == "moe":  # the unpacked (per-expert) layout serves the same function
        mint(
            "adapter",
            "convert",
            str(tmp_path / "a"),
            str(tmp_path / "u"),
            "--base",
            str(base_dir),
            "--layout",
            "unpacked",
        )
        assert any(".0.gate_proj." in k for k in _keys(tmp_path / "u"))
        engine.load_adapter("u", tmp_path / "u")
        assert torch.allclose(engine.logits(ids[:1], ["u"]), got[:1], atol=1e-6)


def _keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        return list(f.keys())


@pytest.mark.slow  # 16 s; adapter validation: also tests/unit/test_adapter_format.py
def test_inspect_reports_every_problem_and_fails(tmp_path):
    base_dir = tmp_path / "base"
    mint("base", "build-tiny", str(base_dir))
    peft_adapter(base_dir, tmp_path / "a", LoraConfig(r=4, target_modules=["q_proj"]), seed=0)
    weights = tmp_path / "a" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    result = mint("adapter", "inspect", str(tmp_path / "a"), "--base", str(base_dir), check=False)
    assert result.returncode == 1
    assert "truncated" in result.stdout and str(tmp_path / "a") in result.stdout.replace("\n", "")


def test_demo_runs_and_every_mixed_row_matches_its_solo_run(tmp_path):
    result = mint("demo", "--workdir", str(tmp_path / "demo"))
    assert "in ONE batch" in result.stdout
    assert "is refused before anything changes" in result.stdout
    assert result.stdout.count("✓") >= 5 + 4  # four steps + five rows
    assert "✗" not in result.stdout


@pytest.mark.slow  # 17 s; `mint train` on a user's task: also test_mint_train_trains_a_users_task
def test_mint_train_writes_curves_summary_and_revisions(tmp_path):
    base = tmp_path / "base"
    mint("base", "build-tiny", str(base), "--family", "dense", "--seed", "0")
    out = tmp_path / "run"
    mint(
        "train", "--policies", "add,sort", "--base", str(base), "--steps", "2", "--prompts", "2",
        "--group", "2", "--out", str(out),
    )  # fmt: skip
    rows = list(csv.DictReader((out / "curve.csv").open()))
    assert [(r["step"], r["policy"]) for r in rows] == [
        ("1", "add"),
        ("1", "sort"),
        ("2", "add"),
        ("2", "sort"),
    ]
    assert all(0.0 <= float(r["reward"]) <= 1.0 and float(r["seconds"]) > 0 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and set(summary["policies"]) == {"add", "sort"}
    for name in ("add", "sort"):
        scores = summary["policies"][name]
        assert 0.0 <= scores["heldout_before"] <= 1.0 and 0.0 <= scores["heldout_after"] <= 1.0
        assert (out / "revisions" / f"{name}-step2" / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00002"]  # the final one
    assert (out / "checkpoints" / "step-00002" / "state.json").is_file()
    assert json.loads((out / "checkpoints" / "step-00002" / "run.json").read_text())["args"]["policies"] == [
        "add",
        "sort",
    ]


def test_mint_train_trains_a_users_task(tmp_path):
    """`mint train` takes any registered task: a user's folder (parquet train rows, its own column names), its
    held-out rows scored before and after, its rewards scoring the rollouts."""
    base = tmp_path / "base"
    mint("base", "build-tiny", str(base), "--family", "dense", "--seed", "0")
    out = tmp_path / "run"
    shout = Path(__file__).resolve().parents[2] / "examples" / "shout"
    result = mint(
        "train", "--tasks", str(shout), "--policies", "shout", "--base", str(base), "--steps", "2", "--prompts",
        "2", "--group", "2", "--heldout", "20", "--out", str(out),
    )  # fmt: skip
    assert "shout" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["policies"]) == {"shout"}
    assert (out / "revisions" / "shout-step2" / "adapter_model.safetensors").is_file()
    rows = list(csv.DictReader((out / "curve.csv").open()))
    assert [(r["step"], r["policy"]) for r in rows] == [("1", "shout"), ("2", "shout")]


@pytest.mark.slow  # three training runs (45 s); resuming: also tests/unit/test_trainer.py
def test_mint_train_interrupted_and_resumed_ends_where_an_uninterrupted_run_does(tmp_path):
    """Ctrl-C stops after the step under way and saves a checkpoint; --resume continues from it with the same
    prompts and samples, so the exported revisions are byte for byte those of a run that was never stopped."""
    base = tmp_path / "base"
    mint("base", "build-tiny", str(base), "--family", "dense", "--seed", "0")
    common = ("train", "--policies", "add,sort", "--base", str(base), "--prompts", "2", "--group", "2")

    out = tmp_path / "stopped"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mint_app.cli.app", *common, "--steps", "1000", "--checkpoint-every", "1",
         "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "step-00002").is_dir():
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stdout.read() if proc.stdout else ""
            )
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    assert "stopping after this step" in output and "continue with --resume" in output
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    stopped_at = int(kept[-1].split("-")[1])
    assert 2 <= stopped_at < 1000 and len(kept) == 2  # checkpoints are kept two deep
    end = stopped_at + 2

    # --steps below what is done, another rank, or nothing to resume: refused, naming why, nothing changed
    refused = mint(*common, "--steps", str(stopped_at), "--out", str(out), "--resume", check=False)
    assert refused.returncode == 2 and f"at step {stopped_at} already" in refused.stderr.replace("\n", "")
    refused = mint(*common, "--steps", str(end), "--rank", "4", "--out", str(out), "--resume", check=False)
    assert refused.returncode == 2 and "rank 8 then, 4 now" in refused.stderr.replace("\n", "")
    refused = mint(*common, "--steps", str(end), "--out", str(tmp_path / "empty"), "--resume", check=False)
    assert refused.returncode == 2 and "no checkpoint" in refused.stderr.replace("\n", "")
    refused = mint(*common, "--steps", "100000", "--out", str(tmp_path / "big"), check=False)
    assert refused.returncode == 2 and "200000 distinct train prompts" in refused.stderr.replace("\n", "")
    assert not (tmp_path / "big").exists()

    done = mint(*common, "--steps", str(end), "--out", str(out), "--resume")
    assert f"resuming from {out / 'checkpoints'}" in done.stdout.replace("\n", "")
    mint(*common, "--steps", str(end), "--out", str(tmp_path / "straight"))
    for name in ("add", "sort"):
        rev = Path("revisions") / f"{name}-step{end}" / "adapter_model.safetensors"
        assert (out / rev).read_bytes() == (tmp_path / "straight" / rev).read_bytes(), name
    rows = list(csv.DictReader((out / "curve.csv").open()))
    assert [int(r["step"]) for r in rows] == [s for s in range(1, end + 1) for _ in ("add", "sort")]
