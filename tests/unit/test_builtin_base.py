"""The built-in base's data and pretraining: task files and corpus are reproducible and held-out sets disjoint
from train; a short pretraining run lowers the loss and writes a base that `load_base` and the engine accept."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mint_core.data.build import (
    CORPUS,
    DataParams,
    parse_line,
    read_corpus,
    read_split,
    render,
    write_task_data,
)
from mint_core.data.generators import Example, read_jsonl
from mint_core.engine.base import load_base
from mint_core.engine.cpu_pin import PINNED_CAPABILITY, REPRODUCIBLE_CPU_ENV
from mint_core.engine.pretrain import (
    TIMINGS,
    PretrainParams,
    encode_corpus,
    lr_at,
    pretrain,
    sampling_weights,
)
from mint_core.engine.tokenizer import byte_tokenizer

TASKS = ["copy", "add"]

# A few seconds of CPU: big enough to learn something, small enough for the unit tier.
TINY = dict(
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
    steps=20,
    batch_size=16,
    seq_len=24,
    lr=1e-2,
    warmup_steps=2,
    eval_per_task=8,
    log_every=5,
)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tasks")
    write_task_data(d, TASKS, n_train=200, n_heldout=30, seed=3)
    return d


def test_task_files_and_corpus(task_dir: Path) -> None:
    for name in TASKS:
        train = read_jsonl(task_dir / "train" / f"{name}.jsonl")
        heldout = read_jsonl(task_dir / "heldout" / f"{name}.jsonl")
        assert (len(train), len(heldout)) == (200, 30)
        assert {e.task for e in train + heldout} == {name}
        assert not {e.prompt for e in train} & {e.prompt for e in heldout}, "held-out prompt seen in train"
    pairs = read_corpus(task_dir / CORPUS)
    assert len(pairs) == 400
    train_pairs = {(e.prompt, e.answer) for name in TASKS for e in read_split(task_dir, "train")[name]}
    assert set(pairs) == train_pairs  # the corpus is exactly the train sets
    assert [p.split(":")[0] for p, _ in pairs[:20]] != ["copy"] * 20, "tasks are interleaved"
    manifest = json.loads((task_dir / "manifest.json").read_text())
    assert manifest["counts"]["add"] == {"train": 200, "heldout": 30}


def test_task_data_is_reproducible(task_dir: Path, tmp_path: Path) -> None:
    write_task_data(tmp_path / "again", TASKS, n_train=200, n_heldout=30, seed=3)
    write_task_data(tmp_path / "other", TASKS, n_train=200, n_heldout=30, seed=4)
    same = (task_dir / CORPUS).read_bytes() == (tmp_path / "again" / CORPUS).read_bytes()
    assert same
    assert (task_dir / CORPUS).read_bytes() != (tmp_path / "other" / CORPUS).read_bytes()


def test_render_round_trips() -> None:
    ex = Example("add-0-0", "add", "add: 12+30 =", "42")
    line = render(ex)
    assert line == "add: 12+30 = 42<eos>"
    assert parse_line(line + "\n") == (ex.prompt, ex.answer)
    with pytest.raises(ValueError):
        parse_line("no separator")


def test_params_sections_are_checked() -> None:
    assert DataParams(tasks=["copy"]).tasks == ["copy"]
    with pytest.raises(ValueError):
        DataParams(tasks=["nope"])
    with pytest.raises(ValueError):
        PretrainParams(stepz=3)  # type: ignore[call-arg]


def test_encode_masks_prompt_and_padding() -> None:
    tok = byte_tokenizer()
    ids, kind = encode_corpus([("copy: ab =", "ab")], tok, seq_len=16)
    prompt = tok("copy: ab =")["input_ids"]
    answer = [*tok(" ab")["input_ids"], tok.eos_token_id]
    n = len(prompt) + len(answer)
    assert ids[0, :n].tolist() == prompt + answer
    assert (ids[0, n:] == tok.pad_token_id).all()
    assert kind[0, : len(prompt)].eq(0.5).all() and kind[0, len(prompt) : n].eq(1.0).all()
    assert kind[0, n:].eq(0).all()


def test_task_weights_tilt_sampling() -> None:
    pairs = [("add: 1+2 =", "3"), ("copy: ab =", "ab"), ("sort: 21 =", "12")]
    w = sampling_weights(pairs, {"add": 2.0, "reverse": 0.5})  # reverse is not in the corpus: ignored
    assert w.tolist() == [2.0, 1.0, 1.0]
    with pytest.raises(ValueError):
        sampling_weights(pairs, {"add": 0.0, "copy": 0.0, "sort": 0.0})


def test_lr_schedule() -> None:
    p = PretrainParams(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, p) == pytest.approx(0.1)
    assert lr_at(9, p) == pytest.approx(1.0)
    assert lr_at(99, p) == pytest.approx(0.1, abs=1e-3)
    assert all(lr_at(s, p) >= lr_at(s + 1, p) for s in range(10, 99))


def test_pretrain_lowers_loss_and_writes_a_loadable_base(task_dir: Path, tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    m = pretrain(
        tmp_path / "base",
        PretrainParams(**TINY),
        task_dir,
        tmp_path / "m" / "x.json",
        progress=False,
        timings_path=tmp_path / "t" / "timings.json",
    )
    assert torch.get_num_threads() == threads  # restored
    losses = [h["loss"] for h in m["loss_history"]]
    assert losses[-1] < losses[0] - 0.5, losses
    assert set(m["heldout"]) == set(TASKS)
    for v in m["heldout"].values():
        assert v["n"] == 8 and 0 <= v["exact_match"] <= v["well_formed"] + 1e-9 <= 1 + 1e-9
    # the wall times go to the timings file only: the base directory and the metrics file (both hashed by DVC)
    # hold what a rebuild of the same weights reproduces
    on_disk = json.loads((tmp_path / "base" / "metrics.json").read_text())
    metrics = json.loads((tmp_path / "m" / "x.json").read_text())
    timings = json.loads((tmp_path / "t" / "timings.json").read_text())
    assert on_disk == metrics == {k: v for k, v in m.items() if k not in TIMINGS}
    assert set(timings) == set(TIMINGS) and all(m[k] == timings[k] >= 0 for k in TIMINGS)
    assert on_disk["heldout"] == m["heldout"]

    base = load_base(tmp_path / "base")
    assert base.tokenizer is not None and len(base.tokenizer) == 259
    assert base.config.model_type == "llama" and base.config.vocab_size == 259
    assert base.sites  # LoRA can attach


# What a machine or a shell can show pretraining beyond AVX2: AVX-512 and AMX kernels in ATen, oneDNN and MKL,
# and another thread count. On an Intel Xeon each would change the bytes if the pin let it through.
WIDER_CPU_ENV = {
    "ATEN_CPU_CAPABILITY": "avx512",
    "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX",
    "MKL_CBWR": "AUTO",
    "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    "OMP_NUM_THREADS": "1",
}


def test_mint_base_pretrain_pins_the_kernels_and_rebuilds_the_same_bytes(
    task_dir: Path, tmp_path: Path
) -> None:
    """`mint base pretrain` computes with AVX2 kernels whatever the CPU and the environment show (cpu_pin), records
    so in its metrics, and its first steps give the same weights with AVX-512 visible and without: the property
    dvc.lock's hash of data/base relies on. On a CPU without AVX-512 the wider build falls back to AVX2 by itself;
    on an Intel Xeon the pin alone keeps the bytes equal."""
    params = tmp_path / "params.yaml"
    params.write_text(json.dumps({"base": {**TINY, "steps": 8, "threads": 2}}))
    plain = {k: v for k, v in os.environ.items() if k not in REPRODUCIBLE_CPU_ENV and k not in WIDER_CPU_ENV}
    digests = []
    for i, env in enumerate([plain, {**plain, **WIDER_CPU_ENV}]):
        out = tmp_path / f"b{i}"
        mint = str(Path(sys.executable).parent / "mint")
        done = subprocess.run(
            [mint, "base", "pretrain", "--data", str(task_dir), "--out", str(out), "--params", str(params)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads((out / "metrics.json").read_text())["cpu_capability"] == PINNED_CAPABILITY
        digests.append(hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1], "the weights differ with AVX-512 visible: a kernel escapes the pin"
