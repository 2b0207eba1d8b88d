"""One revision scored two ways by lm-eval: served (local-completions against `mint serve`, the revision loaded
under a candidate name) and in process (lm-eval's hf model, the adapter applied by PEFT). Both must give the same
per-suite scores and the same per-sample answers; the result goes to a real MLflow server and reads back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from mint_core.engine.base import build_tiny_base, load_base
from mint_core.engine.tokenizer import byte_tokenizer
from mint_core.eval.in_process import evaluate_in_process
from mint_core.eval.lm_eval_runner import evaluate_served
from mint_core.eval.records import load_from_mlflow, log_to_mlflow
from mint_core.eval.results import (
    EvalConfig,
    EvalError,
    EvalResult,
    LocalModel,
    ServedModel,
    differences,
)
from mint_core.eval.suites import SuiteError, standalone_suites
from mint_core.lora.adapter import random_adapter, save_adapter
from mint_testkit.harness import free_port, start_server, stop_server

pytestmark = pytest.mark.integration

LIMIT = 6  # items per lm-eval task: 5 task suites + 2 guard tasks
SUITES = ["add", "reverse", "copy", "upper", "sort", "guard"]
BUILTIN = Path(__file__).resolve().parents[2] / "data" / "base"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Setup:
    base_dir: Path
    store: Path
    url: str
    suites: Path  # mint's suite YAMLs with their data built (eval_suites/data is a DVC output)

    def config(self, suites: list[str], limit: int = LIMIT) -> EvalConfig:
        return EvalConfig(suites=suites, limit=limit, batch_size=16, suites_dir=self.suites)


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `mlflow server` (SQLite backend, proxied artifact store) in its own process group."""
    d = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="mlflow-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{d / 'mlflow.db'}",
            "--artifacts-destination",
            str(d / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # uvicorn runs as a child: stop the whole group
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"mlflow server exited with {proc.returncode}:\n{Path(log.name).read_text()}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server not up in 90 s:\n{Path(log.name).read_text()}")
            time.sleep(0.3)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """The built-in base if `dvc repro` built it (data/base), else a tiny random base written as a HF directory;
    served by `mint serve --base <dir>` over an adapter store holding two random (non-zero) revisions for it."""
    root = tmp_path_factory.mktemp("eval")
    base_dir, std = BUILTIN, 0.02  # small: the built-in base keeps part of its skill, so scores are not all 0
    if not (BUILTIN / "config.json").is_file():
        base_dir, std = root / "base", 0.1
        tiny = build_tiny_base("dense", seed=0, tokenizer=byte_tokenizer())
        tiny.model.save_pretrained(base_dir)
        assert tiny.tokenizer is not None
        tiny.tokenizer.save_pretrained(base_dir)
    base = load_base(base_dir)  # the fingerprint the server will see
    store = root / "store"
    store.mkdir()
    for i, name in enumerate(["rev1", "rev2"]):
        a = random_adapter(base.sites, TARGETS, 8, seed=i + 1, std=std, base_fingerprint=base.fingerprint)
        save_adapter(a, store / name, base.sites)
    suites = standalone_suites(root, limit=100)
    proc, url = start_server(store, "--base", str(base_dir), env={"MINT_SERVE_TORCH_THREADS": "1"})
    try:
        yield Setup(base_dir, store, url, suites)
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def both(setup: Setup) -> tuple[EvalResult, EvalResult]:
    cfg = setup.config(SUITES)
    served = evaluate_served(
        ServedModel(
            url=setup.url,
            tokenizer=setup.base_dir,
            adapter=str(setup.store / "rev1"),
            admin_token=SecretStr("admin-secret"),
        ),
        cfg,
    )
    local = evaluate_in_process(LocalModel(base=setup.base_dir, adapter=setup.store / "rev1"), cfg)
    return served, local


def test_served_and_in_process_paths_agree(setup: Setup, both: tuple[EvalResult, EvalResult]) -> None:
    served, local = both
    assert served.path == "served" and local.path == "in_process"
    assert served.revision is not None and served.revision == local.revision  # the same bytes were scored
    assert list(served.suites) == SUITES == list(local.suites)
    for name in SUITES:
        s, lo = served.suites[name], local.suites[name]
        want_n = 2 * LIMIT if name == "guard" else LIMIT
        assert s.n == lo.n == want_n == len(s.samples)
        assert s.metrics == lo.metrics and s.score == lo.score
        assert set(s.metrics) == ({"exact_match", "acc"} if name == "guard" else {"exact_match"})
        assert [x.response for x in s.samples] == [x.response for x in lo.samples]
        assert [x.correct for x in s.samples] == [x.correct for x in lo.samples]
    # log-likelihood items: the engine's prompt logprobs and PEFT's agree closely, not just in their argmax
    assert differences(served, local, ll_tol=1e-4) == []
    choice = [x for x in served.suites["guard"].samples if x.loglikelihoods]
    assert len(choice) == LIMIT and all(len(x.loglikelihoods or []) == 2 for x in choice)
    # per-sample correctness is what the score is made of
    for s in served.suites.values():
        assert s.score == pytest.approx(sum(x.correct for x in s.samples) / s.n)
    # the served name holds the revision scored
    with httpx.Client(base_url=setup.url) as c:
        card = next(m for m in c.get("/v1/models").json()["data"] if m["id"] == "candidate")
    assert card["revision"] == served.revision


def test_the_adapter_is_what_is_scored(setup: Setup, both: tuple[EvalResult, EvalResult]) -> None:
    """The bare base answers differently from the revision (so agreement above is not the base agreeing with
    itself), and the served path swaps `candidate` in place to another revision and scores that one."""
    served, _ = both
    cfg = setup.config(["add", "guard"])
    bare = evaluate_in_process(LocalModel(base=setup.base_dir), cfg)
    served_bare = evaluate_served(ServedModel(url=setup.url, tokenizer=setup.base_dir), cfg)
    assert bare.revision is None and served_bare.revision is None and served_bare.model == setup.base_dir.name
    assert differences(served_bare, bare, ll_tol=1e-4) == []
    gap = max(
        abs(p - q)
        for x, y in zip(bare.suites["guard"].samples, served.suites["guard"].samples, strict=True)
        for p, q in zip(x.loglikelihoods or [], y.loglikelihoods or [], strict=True)
    )
    assert gap > 1e-3

    other = evaluate_served(
        ServedModel(
            url=setup.url,
            tokenizer=setup.base_dir,
            adapter="rev2",  # relative to the server's adapter store
            admin_token=SecretStr("admin-secret"),
            unload_after=True,
        ),
        cfg,
    )
    assert other.revision not in (None, served.revision)
    local = evaluate_in_process(LocalModel(base=setup.base_dir, adapter=setup.store / "rev2"), cfg)
    assert differences(other, local, ll_tol=1e-4) == []
    with httpx.Client(base_url=setup.url) as c:
        assert "candidate" not in {m["id"] for m in c.get("/v1/models").json()["data"]}


def test_the_guard_takes_its_own_number_of_items(setup: Setup) -> None:
    """`guard_limit` sizes the guard's two tasks apart from the task suites' `limit` (the gate's guard needs more
    items than a task suite), both paths scoring the first items of each task; without it the guard's tasks
    take `limit` each."""
    cfg = EvalConfig(suites=["add", "guard"], limit=4, guard_limit=7, batch_size=16, suites_dir=setup.suites)
    served = evaluate_served(ServedModel(url=setup.url, tokenizer=setup.base_dir), cfg)
    local = evaluate_in_process(LocalModel(base=setup.base_dir), cfg)
    for r in (served, local):
        assert r.suites["add"].n == 4 and [x.doc_id for x in r.suites["add"].samples] == list(range(4))
        guard = r.suites["guard"]
        assert guard.n == 14
        for task in ("guard_generate", "guard_choice"):
            assert [x.doc_id for x in guard.samples if x.task.endswith(task)] == list(range(7))
    assert differences(served, local, ll_tol=1e-4) == []
    same = evaluate_in_process(LocalModel(base=setup.base_dir), cfg.model_copy(update={"guard_limit": None}))
    assert same.suites["guard"].n == 8 and same.suites["add"].n == 4


def test_result_is_logged_to_mlflow_and_reads_back(
    mlflow_uri: str, both: tuple[EvalResult, EvalResult]
) -> None:
    from mlflow import MlflowClient

    served, local = both
    client = MlflowClient(mlflow_uri)
    exp = client.create_experiment(f"eval-paths-{time.time_ns()}")
    runs = {}
    for result in (served, local):
        run_id = client.create_run(exp).info.run_id
        log_to_mlflow(result, mlflow_uri, run_id)
        runs[result.path] = run_id

    metrics = {p: client.get_run(r).data.metrics for p, r in runs.items()}
    assert metrics["served"].pop("eval/wall_s") > 0 and metrics["in_process"].pop("eval/wall_s") > 0
    assert metrics["served"] == metrics["in_process"]  # the same scores, by name
    m = metrics["served"]
    for name, s in served.suites.items():
        assert m[f"eval/{name}/exact_match"] == s.metrics["exact_match"]
        assert m[f"eval/{name}/n"] == s.n
        assert m[f"eval/{name}/score"] == s.score
    assert m["eval/guard/acc"] == served.suites["guard"].metrics["acc"]
    tags = client.get_run(runs["served"]).data.tags
    assert tags["mint.eval.path"] == "served" and tags["mint.eval.revision"] == served.revision

    back = load_from_mlflow(mlflow_uri, runs["served"])
    assert back == served
    assert back.raw["results"]["mint_add"]["exact_match,strip"] == served.suites["add"].metrics["exact_match"]
    gate = back.gate_scores()
    assert gate["guard"].n == 2 * LIMIT and gate["guard"].correct == [
        x.correct for x in served.suites["guard"].samples
    ]

    with pytest.raises(EvalError, match="no evaluation under other/"):
        load_from_mlflow(mlflow_uri, runs["served"], prefix="other")


ERRORS = [
    ("unknown suite", {"suites": ["nope"]}, "unknown suites \\['nope'\\]; known in .*add"),
    ("unreachable server", {"url": "http://127.0.0.1:9"}, "unreachable"),
    ("adapter not in the store", {"adapter": "no-such-revision"}, "loading revision 'no-such-revision'"),
    ("no tokenizer", {"tokenizer": Path("/nonexistent")}, "has no tokenizer.json"),
    ("load without the admin token", {"admin_token": None}, "401"),
]


@pytest.mark.parametrize(("case", "change", "expected"), ERRORS, ids=[e[0] for e in ERRORS])
def test_served_errors_name_what_was_wrong(setup: Setup, case: str, change: dict, expected: str) -> None:
    fields = {
        "url": setup.url,
        "tokenizer": setup.base_dir,
        "adapter": "rev1",
        "admin_token": SecretStr("admin-secret"),
    }
    change = dict(change)
    suites = change.pop("suites", ["add"])
    target = ServedModel(**(fields | change))
    with pytest.raises((EvalError, SuiteError), match=expected):
        evaluate_served(target, setup.config(suites, limit=1))


def test_eval_commands_write_the_same_scores(setup: Setup, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mint_app.cli.app import app

    common = ["--suites", "add,guard", "--limit", "3", "--suites-dir", str(setup.suites)]
    at_server = ["--url", setup.url, "--tokenizer", str(setup.base_dir), "--admin-token", "admin-secret"]
    served = CliRunner().invoke(
        app,
        ["eval", "served", *at_server, "--adapter", "rev1", "--out", str(tmp_path / "served.json"), *common],
    )
    assert served.exit_code == 0, served.output
    in_process = ["--base", str(setup.base_dir), "--adapter", str(setup.store / "rev1")]
    local = CliRunner().invoke(
        app, ["eval", "local", *in_process, "--out", str(tmp_path / "local.json"), *common]
    )
    assert local.exit_code == 0, local.output
    a = EvalResult.model_validate_json((tmp_path / "served.json").read_text())
    b = EvalResult.model_validate_json((tmp_path / "local.json").read_text())
    assert a.suites["guard"].n == 6 and differences(a, b) == []
    bad = CliRunner().invoke(app, ["eval", "local", "--base", str(tmp_path), *common])
    assert bad.exit_code == 1 and "has no config.json" in " ".join(bad.output.split())
