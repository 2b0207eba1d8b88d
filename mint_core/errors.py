"""Errors that name what was wrong, shared by every layer of mint."""

from __future__ import annotations


class MintError(Exception):
    """Base class for errors mint raises on purpose."""


class AdapterError(MintError):
    """An adapter revision could not be read, validated or placed; names the adapter and its path."""

    def __init__(self, adapter: str, path: str | None, problems: list[str]):
        self.adapter = adapter
        self.path = path
        self.problems = list(problems)
        where = f" at {path}" if path else ""
        body = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"adapter {adapter!r}{where} is invalid ({len(self.problems)} problem(s)):\n{body}")


class WorkingSetFull(MintError):
    """Every device slot is pinned or in use by a running request, so nothing can be evicted."""


class UnknownAdapter(MintError):
    """An adapter name that the engine has never been given."""


class DataCheckError(MintError):
    """A dataset failed its Great Expectations suite; lists every failing expectation with its column and what
    was observed. `result_json` is the full validation result (JSON-ready), for a run to store."""

    def __init__(self, suite: str, source: str | None, failures: list[str], result_json: dict | None = None):
        self.suite = suite
        self.source = source
        self.failures = list(failures)
        self.result_json = result_json or {}
        where = f" on {source}" if source else ""
        body = "\n".join(f"  - {f}" for f in self.failures)
        super().__init__(f"data check {suite!r}{where} failed ({len(self.failures)} expectation(s)):\n{body}")


class BaseError(MintError):
    """A base model directory that mint cannot train or serve; names the directory and every problem found."""

    def __init__(self, path: str, problems: list[str]):
        self.path = path
        self.problems = list(problems)
        body = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"base {path} cannot be used ({len(self.problems)} problem(s)):\n{body}")
