"""Replica control's restart loop (serving/replica_control.py): a restarting replica fails in the ways a restart
fails (refused connections, 503s) quietly, anything else is logged with its traceback, and the loop still waits for
the replica to come back."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from mint_core.serving import replica_control
from mint_core.serving.replica_control import Event, Restart
from mint_core.serving.swap_lock import SwapLock

URL = "http://127.0.0.1:9001"


def test_a_restart_logs_what_it_did_not_expect_with_its_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(replica_control, "POLL_S", 0.0)
    monkeypatch.setattr(replica_control, "listening_pid", lambda url: None)  # nothing to kill here
    health = httpx.AsyncClient(base_url=URL, transport=httpx.MockTransport(lambda r: httpx.Response(200)))
    answers: list[BaseException | list[str]] = [
        httpx.ConnectError("refused"),  # restarting: expected, no traceback
        KeyError("choices"),  # a bug: logged with its traceback
        KeyError("choices"),  # the same again: once is enough
        ["recorded"],
    ]

    async def ask() -> list[str] | None:
        got = answers.pop(0)
        if isinstance(got, BaseException):
            raise got
        return got

    async def no_drain(batch: SwapLock) -> None:
        return None  # one vLLM: nothing else could take its requests

    event = Event(0.0, "test", [])
    restart = Restart(URL, "127.0.0.1:9001", health, ask, ["recorded"], no_drain)
    with caplog.at_level(logging.DEBUG, logger=replica_control.__name__):
        assert asyncio.run(restart.run(event, SwapLock())) is True
    assert answers == [] and event.clean is True and event.back is not None
    traced = [r for r in caplog.records if r.exc_info]
    assert len(traced) == 1, [r.getMessage() for r in caplog.records]
    assert traced[0].exc_info is not None and traced[0].exc_info[0] is KeyError
    assert any("not back yet" in r.getMessage() and "refused" in r.getMessage() for r in caplog.records)
