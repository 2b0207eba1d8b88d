"""docs/command-line.md lists every `mint` command, and every command and option it names exists."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from mint_app.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "command-line.md"


def _commands(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every command of the CLI (groups walked down to their commands), by its path of names."""
    if hasattr(cmd, "commands"):
        for name, sub in cmd.commands.items():
            if not sub.hidden:
                yield from _commands(sub, (*path, name))
    else:
        yield path, cmd


COMMANDS = dict(_commands(typer.main.get_command(app)))
ROOT_GROUP = typer.main.get_command(app)


def _named(line: str) -> list[tuple[tuple[str, ...], list[str]]]:
    """The commands a doc line names, each with the options written after it. A line is
    `mint <names> [args and options] | <names> [...]   <description>`; `a|b` names two commands of one group,
    and an alternative after ` | ` a command beside the first one."""
    usage = re.split(r"\s{3,}", line.strip())[0]
    found: list[tuple[tuple[str, ...], list[str]]] = []
    parent: tuple[str, ...] = ()
    for i, alt in enumerate(usage.split(" | ")):
        tokens = alt.split()
        if i == 0:
            assert tokens[0] == "mint", line
            tokens = tokens[1:]
        group, path, paths = ROOT_GROUP, parent, [parent]
        for name in parent:
            group = group.commands[name]
        for n, token in enumerate(tokens):
            subs = getattr(group, "commands", None)
            names = token.split("|")
            if subs is None or not all(name in subs for name in names):
                break
            paths = [(*path, name) for name in names]
            path, group = paths[0], subs[names[0]]
            rest = tokens[n + 1 :]
        else:
            rest = []
        assert paths != [parent], f"{line!r}: {alt!r} names no mint command"
        options = [re.sub(r"[\[\]]", "", t) for t in rest if t.lstrip("[").startswith("--")]
        found += [(p, options) for p in paths]
        parent = paths[0][:-1]
    return found


def _doc_lines() -> list[str]:
    block = re.search(r"```\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None
    return [line for line in block.group(1).splitlines() if line.startswith("mint ")]


def test_the_doc_lists_every_command() -> None:
    named = {path for line in _doc_lines() for path, _ in _named(line)}
    missing = sorted(" ".join(p) for p in set(COMMANDS) - named)
    assert missing == [], f"commands missing from {DOC.name}: {missing}"


def test_every_command_and_option_the_doc_names_exists() -> None:
    wrong = []
    for line in _doc_lines():
        for path, options in _named(line):
            if path not in COMMANDS:
                wrong.append(f"{' '.join(path)}: not a command")
                continue
            known = {o for p in COMMANDS[path].params for o in (*p.opts, *p.secondary_opts)}
            wrong += [f"mint {' '.join(path)} {o}: no such option" for o in options if o not in known]
    assert wrong == []


def test_the_parser_reads_the_doc_s_shapes() -> None:
    # the shapes the list uses, read as meant: alternatives of one group, commands beside each other, options
    assert _named("mint registry ls|lineage   the registry") == [
        (("registry", "ls"), []),
        (("registry", "lineage"), []),
    ]
    assert _named("mint up [--tasks DIR] | status | down   services") == [
        (("up",), ["--tasks"]),
        (("status",), []),
        (("down",), []),
    ]
    assert _named("mint base build-tiny OUT --family dense|moe   a base") == [
        (("base", "build-tiny"), ["--family"])
    ]
