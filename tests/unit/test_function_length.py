"""Every function reads top to bottom: none outside benchmarks/ and scripts/ is 100 lines or longer (a longer one
holds several steps, each of which can be named; docs/layout.md says so)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["mint_core", "mint_app", "flows", "tasks", "mint_testkit", "vllm_plugin", "tests"]
LIMIT = 100


def long_functions(root: Path, packages: list[str], limit: int) -> list[str]:
    out = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            if any(part in {"build", ".venv"} for part in path.relative_to(root).parts):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    n = (node.end_lineno or node.lineno) - node.lineno + 1
                    if n >= limit:
                        out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_is_100_lines_or_longer() -> None:
    assert long_functions(ROOT, PACKAGES, LIMIT) == []


def test_the_check_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"def long():\n{body}\n\n\ndef short():\n    return 1\n")
    assert long_functions(tmp_path, ["pkg"], LIMIT) == [f"pkg/m.py:1 long ({LIMIT + 1} lines)"]
