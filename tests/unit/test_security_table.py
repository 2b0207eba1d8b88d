"""docs/security.md's security table: every row names a test of the default run that exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _rows() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "security.md").read_text()
    table = text.split("## Security table", 1)[1]
    return re.findall(r"^\|.*`(tests/[\w/]+\.py)::(\w+)` \|$", table, flags=re.M)


def _slow(fn: ast.FunctionDef, module: ast.Module) -> bool:
    marks = [ast.unparse(d) for d in fn.decorator_list]
    marks += [
        ast.unparse(n.value)
        for n in module.body
        if isinstance(n, ast.Assign) and "pytestmark" in ast.unparse(n)
    ]
    return any("slow" in m for m in marks)


def test_every_row_names_a_test_of_the_default_run() -> None:
    rows = _rows()
    assert len(rows) >= 12, rows  # the serving, MLflow, Prefect and mint up rows
    for path, name in rows:
        module = ast.parse((ROOT / path).read_text())
        found = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == name]
        assert found, f"docs/security.md names {path}::{name}, which does not exist"
        assert not _slow(found[0], module), f"{path}::{name} is marked slow: not in the default run"


def test_the_issue_s_cases_each_have_a_row() -> None:
    text = (ROOT / "docs" / "security.md").read_text().split("## Security table", 1)[1]
    for case in ("a viewer", "tenant A's key", "without the string", "a stale key"):
        assert case in text, case
