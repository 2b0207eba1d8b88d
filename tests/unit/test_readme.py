"""The README is what a newcomer reads in five minutes: short, the two commands (CI runs the test one, `.ci/run`),
and links that lead somewhere; everything else is a page of docs/ (built with `mkdocs build --strict` in
`make check`)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_is_short_and_names_the_two_commands() -> None:
    assert len(README.splitlines()) <= 150
    assert "make run" in README and "make test" in README
    assert "make test" in (ROOT / ".ci" / "run").read_text()  # the README's test command is what CI runs


def test_readme_links_lead_somewhere() -> None:
    links = [t for t in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README) if "://" not in t]
    assert links
    assert [t for t in links if not (ROOT / t).exists()] == []


def test_every_docs_page_is_in_the_nav() -> None:
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    pages = {page for entry in nav for page in entry.values()}
    assert pages == {p.name for p in (ROOT / "docs").glob("*.md")}
