"""The Prefect server's logging config as `mint up` writes it: Prefect's own, plus a filter that turns the SQLite
busy-heartbeat ERROR into a one-line WARNING that says why it is harmless, and lets every other record pass."""

from __future__ import annotations

import importlib.util
import logging
import logging.config
import sqlite3
import sys
from pathlib import Path

import pytest
import sqlalchemy.exc

from mint_app.services.prefect_logging import (
    HARMLESS,
    HEARTBEAT_LOGGER,
    RECORDER_LOGGER,
    REQUEUED,
    RETRIED,
    RETRY_LOGGER,
    RETRYING,
    STATE_LOGGER,
    STATE_VALIDATION,
    SQLiteBusyFlush,
    SQLiteBusyHeartbeat,
    SQLiteBusyRetry,
    SQLiteBusyStateWrite,
    write_config,
)


def record_of(exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        info = sys.exc_info()
    return logging.LogRecord(
        HEARTBEAT_LOGGER,
        logging.ERROR,
        __file__,
        1,
        "Worker channel heartbeat persistence failed: work_pool=%s",
        ("mint-process",),
        info,
    )


def busy() -> BaseException:
    driver = sqlite3.OperationalError("database is locked")
    return sqlalchemy.exc.OperationalError("UPDATE worker SET ...", {}, driver)


def test_a_busy_heartbeat_becomes_a_one_line_warning() -> None:
    r = record_of(busy())
    assert SQLiteBusyHeartbeat().filter(r)
    assert (r.levelno, r.levelname, r.getMessage(), r.exc_info) == (
        logging.WARNING,
        "WARNING",
        HARMLESS,
        None,
    )


@pytest.mark.parametrize(
    "exc",
    [
        sqlalchemy.exc.OperationalError("SELECT", {}, sqlite3.OperationalError("no such table: worker")),
        RuntimeError("database is locked"),  # not SQLite's: someone else's words
        ValueError("boom"),
    ],
)
def test_every_other_error_passes_as_it_was(exc: BaseException) -> None:
    r = record_of(exc)
    assert SQLiteBusyHeartbeat().filter(r)
    assert (
        r.levelno == logging.ERROR
        and r.exc_info is not None
        and "heartbeat persistence failed" in r.getMessage()
    )


def state_record(exc: BaseException, msg: str = STATE_VALIDATION) -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        info = sys.exc_info()
    return logging.LogRecord(STATE_LOGGER, logging.ERROR, __file__, 1, msg, (), info)


def test_a_busy_state_write_becomes_a_one_line_warning_and_nothing_else_does() -> None:
    """What a fresh clone's `make run` logged once beside a loaded machine (a scheduled run marked Late)."""
    late = sqlalchemy.exc.OperationalError(
        "INSERT INTO flow_run_state ...", {}, sqlite3.OperationalError("database is locked")
    )
    r = state_record(late)
    assert SQLiteBusyStateWrite().filter(r)
    assert (r.levelno, r.getMessage(), r.exc_info) == (logging.WARNING, RETRIED, None)
    for other in (
        state_record(ValueError("a state the rules refuse")),  # a real validation error stays an ERROR
        state_record(late, msg="Something else failed"),  # another message of the server's, busy or not
    ):
        assert SQLiteBusyStateWrite().filter(other)
        assert other.levelno == logging.ERROR and other.exc_info is not None


def retry_record(exc: BaseException, msg: str = "↩ [%s] %s") -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        info = sys.exc_info()
    call = "mark_work_queues_ready(work_queue_ids=[...])"
    return logging.LogRecord(RETRY_LOGGER, logging.ERROR, __file__, 1, msg, ("12ms", call), info)


def test_a_busy_background_task_docket_retries_becomes_a_one_line_warning_naming_it() -> None:
    r = retry_record(busy())
    assert SQLiteBusyRetry().filter(r)
    assert (r.levelno, r.levelname, r.exc_info) == (logging.WARNING, "WARNING", None)
    assert r.getMessage() == RETRYING % "mark_work_queues_ready(work_queue_ids=[...])"
    for other in (
        retry_record(ValueError("a real failure")),  # retried, but not SQLite's busy answer: stays an ERROR
        retry_record(busy(), msg="✗ [%s] %s"),  # any other line of docket's, busy or not
    ):
        assert SQLiteBusyRetry().filter(other)
        assert other.levelno == logging.ERROR and other.exc_info is not None


def flush_record(exc: BaseException, msg: str) -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        info = sys.exc_info()
    return logging.LogRecord(RECORDER_LOGGER, logging.ERROR, __file__, 1, msg, None, info)


def test_a_busy_batch_of_task_run_events_put_back_becomes_a_one_line_warning() -> None:
    r = flush_record(busy(), "Error flushing 3 events (3 to retry, 0 dropped)")
    assert SQLiteBusyFlush().filter(r)
    assert (r.levelno, r.levelname, r.exc_info) == (logging.WARNING, "WARNING", None)
    assert r.getMessage() == REQUEUED % "3"
    for other in (
        flush_record(busy(), "Error flushing 3 events (1 to retry, 2 dropped)"),  # events lost: an ERROR
        flush_record(ValueError("a real failure"), "Error flushing 1 events (1 to retry, 0 dropped)"),
    ):
        assert SQLiteBusyFlush().filter(other)
        assert other.levelno == logging.ERROR and other.exc_info is not None


def test_the_config_is_prefects_own_with_the_filter(tmp_path: Path) -> None:
    spec = importlib.util.find_spec("prefect")
    assert spec is not None and spec.origin is not None
    default = Path(spec.origin).parent / "logging" / "logging.yml"
    out = write_config(default, tmp_path / "logging.yml")
    from prefect.logging.configuration import load_logging_config

    config = load_logging_config(out)  # Prefect's loader: its ${...} settings substituted
    assert config["loggers"][HEARTBEAT_LOGGER]["filters"] == ["sqlite_busy_heartbeat"]
    assert config["loggers"][STATE_LOGGER]["filters"] == ["sqlite_busy_state_write"]
    assert config["loggers"][RETRY_LOGGER]["filters"] == ["sqlite_busy_retry"]
    assert config["loggers"][RECORDER_LOGGER]["filters"] == ["sqlite_busy_flush"]
    assert "${" not in str(config["loggers"][RECORDER_LOGGER]["level"])
    assert "${" not in str(config["loggers"][STATE_LOGGER]["level"])
    assert "${" not in str(config["loggers"][HEARTBEAT_LOGGER]["level"])
    assert set(config["handlers"]) >= {"console", "api"}  # nothing of Prefect's own was dropped
    # the factory the server's dictConfig calls (not configured here: it would replace this process's logging)
    factory = logging.config.BaseConfigurator({}).resolve(config["filters"]["sqlite_busy_heartbeat"]["()"])
    assert factory is SQLiteBusyHeartbeat
