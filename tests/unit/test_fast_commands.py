"""`mint --help` and every read command of `mint registry` / `mint catalog` import nothing of torch,
transformers or mlflow (what made them take 5 s). Checked on `sys.modules` of a fresh interpreter, not by timing;
MLflow's REST API is answered by an in-process fake, so no server is needed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "mlflow")
D1, D2 = "a" * 64, "b" * 64

# Runs in a fresh interpreter: a fake MLflow behind httpx's MockTransport, then the commands, then what got imported.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import httpx
    from typer.testing import CliRunner

    def version(v, digest, parent=""):
        tags = [{"key": "mint.digest", "value": digest}, {"key": "mint.base", "value": "f" * 64},
                {"key": "mint.rank", "value": "2"}, {"key": "mint.parent", "value": parent}]
        return {"name": "p", "version": str(v), "source": "/s/" + digest, "tags": tags, "creation_timestamp": 0}

    VERSIONS = [version(1, "%(d1)s"), version(2, "%(d2)s", "p/v1")]

    def answer(request):
        path, q = request.url.path, dict(request.url.params)
        if path == "/health":
            return httpx.Response(200, text="OK")
        if path.endswith("/registered-models/search"):
            return httpx.Response(200, json={"registered_models": [{"name": "p"}]})
        if path.endswith("/registered-models/get"):
            return httpx.Response(200, json={"registered_model": {"name": "p", "aliases": [
                {"alias": "champion", "version": "2"}]}})
        if path.endswith("/model-versions/search"):
            return httpx.Response(200, json={"model_versions": VERSIONS})
        if path.endswith("/model-versions/get"):
            return httpx.Response(200, json={"model_version": VERSIONS[int(q["version"]) - 1]})
        return httpx.Response(404, json={"error_code": "RESOURCE_DOES_NOT_EXIST", "message": path})

    real_client = httpx.Client
    httpx.Client = lambda *a, **k: real_client(*a, transport=httpx.MockTransport(answer), **k)

    from mint_app.cli.app import app

    runner = CliRunner()
    outputs = {}
    for args in json.loads(sys.argv[1]):
        r = runner.invoke(app, args)
        outputs[" ".join(args)] = [r.exit_code, r.output]
    heavy = sorted({m.split(".")[0] for m in sys.modules} & set(%(heavy)r))
    print(json.dumps({"outputs": outputs, "heavy": heavy}))
    """
)


def _run(args: list[list[str]], env: dict[str, str]) -> dict:
    script = SCRIPT % {"d1": D1, "d2": D2, "heavy": HEAVY}
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(args)],
        capture_output=True,
        text=True,
        env={**env, "COLUMNS": "200"},
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    import os

    from mint_core.registry.catalog import Catalog, CatalogConfig

    url = f"sqlite:///{tmp_path}/catalog.db"
    with Catalog(CatalogConfig(url=url)) as cat:
        cat.register(D1, "f" * 64, 2, "/s/a", policy="p")
        cat.register(D2, "f" * 64, 2, "/s/b", policy="p")
        cat.set_alias("p", "champion", 2)
    return {
        **os.environ,
        "MINT_CATALOG_URL": url,
        "MINT_STORE": str(tmp_path / "store"),
        "MLFLOW_TRACKING_URI": "http://mlflow.invalid:5000",
    }


def test_read_commands_import_no_torch_transformers_or_mlflow(env: dict[str, str]) -> None:
    commands = [
        ["--help"],
        ["registry", "ls"],
        ["registry", "ls", "p"],
        ["registry", "lineage", "p/v2"],
        ["registry", "history", "p"],
        ["catalog", "ls"],
        ["catalog", "resolve", "p"],
        ["catalog", "show", "p"],
    ]
    got = _run(commands, env)
    for cmd, (code, output) in got["outputs"].items():
        assert code == 0, f"mint {cmd}:\n{output}"
    outputs = {cmd: output for cmd, (_, output) in got["outputs"].items()}
    assert "champion" in outputs["registry ls"] and "v2" in outputs["registry ls"]
    assert "p/v1" in outputs["registry lineage p/v2"] and D1[:16] in outputs["registry lineage p/v2"]
    # the bare base is the root of every lineage (revision 0), and the parent of a first revision
    assert "base (v0 of p)" in outputs["registry lineage p/v2"]
    assert "base (" in outputs["registry ls p"]
    assert f"sha256:{D2}" in outputs["catalog resolve p"]
    assert got["heavy"] == [], f"read commands imported {got['heavy']}"
