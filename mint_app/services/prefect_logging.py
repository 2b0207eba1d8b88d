"""The Prefect server's logging, as `mint up` starts it: Prefect's own configuration plus one filter.

On SQLite (the local default), Prefect 3.8's worker-channel heartbeat writes in a deferred transaction: it reads,
then writes, and when another connection committed in between (a flow run's task states, beside the worker's
first poll), SQLite answers "database is locked" at once, whatever its busy timeout. Prefect logs an ERROR with a
traceback, closes the worker's channel, and the worker reconnects: its next heartbeat (every 30 s) is written,
and no flow run is touched (seen in the main job's runs, which all completed beside such errors). The filter
turns that one record into a one-line WARNING that says so; every other record passes as it was. On PostgreSQL
(`prefect_database_url`, the documented scale path) the write takes a row lock and this does not occur.

The same busy answer to a state write (a flow run's new state, or a scheduled run marked Late by Prefect's
late-runs service, seen in a fresh clone's `make run` beside a loaded machine) is logged by `prefect.server` as
"Encountered error during state validation" with a traceback. Prefect itself counts it retryable
(`is_client_retryable_exception`): the API answers 503 and the client writes the state again, and the late-runs
service marks the run on its next pass. A second filter says so in one WARNING line.

The server's background tasks run on docket, which retries a failed one (Prefect declares `mark_work_queues_ready`
and its kin with `Retry(attempts=...)`). Docket logs each retry it schedules as an ERROR with a traceback ("↩
[duration] call"); when the failure was SQLite's busy answer, a third filter says in one WARNING line that the task
is retried. A task that runs out of attempts is logged by docket on another line, which passes as it was.

The task-run recorder writes task-run events in batches; a batch SQLite refused as busy is put back on its queue
and logged as an ERROR with a traceback ("Error flushing N events (N to retry, 0 dropped)"). A fourth filter says
in one WARNING line that the events are written again; a batch that dropped events, and each dropped event's own
line, pass as they were.

Light on purpose: the Prefect server imports it while it configures logging.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Any

import yaml

HEARTBEAT_LOGGER = "prefect.server.utilities.worker_channel"
HARMLESS = (
    "worker heartbeat not written: SQLite was busy (database is locked). Harmless: the worker reconnects and its "
    "next heartbeat is written; no flow run is affected. Prefect on PostgreSQL (prefect_database_url) avoids it."
)


STATE_LOGGER = "prefect.server"
STATE_VALIDATION = "Encountered error during state validation"  # prefect/server/orchestration/rules.py
RETRIED = (
    "a state write was not made: SQLite was busy (database is locked). Prefect counts it retryable: its API answers "
    "503 and the state is written again (by the client, or by the late-runs service on its next pass); no flow run "
    "is lost. Prefect on PostgreSQL (prefect_database_url) avoids it."
)


RETRY_LOGGER = "docket.dependencies"
RETRY_MARK = "↩"  # docket/dependencies/_retry.py: "↩ [%s] %s", a retry scheduled
RETRYING = (
    "background task %s was not done: SQLite was busy (database is locked). Docket retries it (one that runs out "
    "of attempts is logged as an ERROR). Prefect on PostgreSQL (prefect_database_url) avoids it."
)


RECORDER_LOGGER = "prefect.server.services.task_run_recorder"
FLUSH_MARK = "Error flushing "  # prefect/server/services/task_run_recorder.py
REQUEUED = (
    "%s task-run events not written yet: SQLite was busy (database is locked). The recorder put them back on its "
    "queue and writes them again; none was dropped. Prefect on PostgreSQL (prefect_database_url) avoids it."
)


def _sqlite_busy(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, sqlite3.OperationalError) and (
            "database is locked" in str(exc)
            or getattr(exc, "sqlite_errorname", "") in {"SQLITE_BUSY", "SQLITE_BUSY_SNAPSHOT"}
        ):
            return True
        orig = getattr(exc, "orig", None)  # SQLAlchemy's OperationalError wraps the driver's
        exc = orig if isinstance(orig, BaseException) else (exc.__cause__ or exc.__context__)
        seen += 1
    return False


class SQLiteBusyHeartbeat(logging.Filter):
    """A heartbeat write that SQLite refused as busy: a one-line WARNING saying why it is harmless."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and _sqlite_busy(record.exc_info[1]):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = HARMLESS, ()
            record.exc_info, record.exc_text = None, None
        return True


class SQLiteBusyStateWrite(logging.Filter):
    """A state write that SQLite refused as busy (Prefect retries it): a one-line WARNING saying so."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == STATE_VALIDATION and record.exc_info and _sqlite_busy(record.exc_info[1]):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = RETRIED, ()
            record.exc_info, record.exc_text = None, None
        return True


class SQLiteBusyRetry(logging.Filter):
    """A background task docket retries because SQLite was busy: a one-line WARNING naming the task."""

    def filter(self, record: logging.LogRecord) -> bool:
        if (
            isinstance(record.msg, str)
            and record.msg.startswith(RETRY_MARK)
            and record.exc_info
            and _sqlite_busy(record.exc_info[1])
        ):
            call = record.args[-1] if isinstance(record.args, tuple) and record.args else "?"
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = RETRYING, (call,)
            record.exc_info, record.exc_text = None, None
        return True


class SQLiteBusyFlush(logging.Filter):
    """A batch of task-run events SQLite refused as busy, all put back on the queue: a one-line WARNING."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        if (
            isinstance(msg, str)
            and msg.startswith(FLUSH_MARK)
            and msg.endswith(" 0 dropped)")
            and record.exc_info
            and _sqlite_busy(record.exc_info[1])
        ):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = REQUEUED, (msg[len(FLUSH_MARK) :].split(" ", 1)[0],)
            record.exc_info, record.exc_text = None, None
        return True


def write_config(prefect_default: Path, out: Path) -> Path:
    """Prefect's logging.yml (its `${...}` settings placeholders kept) with the filters on the heartbeat logger, on
    the server's own, on docket's retries and on the task-run recorder's."""
    config: dict[str, Any] = yaml.safe_load(prefect_default.read_text())
    config.setdefault("filters", {})["sqlite_busy_heartbeat"] = {"()": f"{__name__}.SQLiteBusyHeartbeat"}
    config.setdefault("loggers", {})[HEARTBEAT_LOGGER] = {
        "level": "${PREFECT_SERVER_LOGGING_LEVEL}",
        "filters": ["sqlite_busy_heartbeat"],
    }
    config["filters"]["sqlite_busy_state_write"] = {"()": f"{__name__}.SQLiteBusyStateWrite"}
    server = config["loggers"].setdefault(STATE_LOGGER, {"level": "${PREFECT_SERVER_LOGGING_LEVEL}"})
    server["filters"] = [*server.get("filters", []), "sqlite_busy_state_write"]
    config["filters"]["sqlite_busy_retry"] = {"()": f"{__name__}.SQLiteBusyRetry"}
    retry = config["loggers"].setdefault(RETRY_LOGGER, {})
    retry["filters"] = [*retry.get("filters", []), "sqlite_busy_retry"]
    config["filters"]["sqlite_busy_flush"] = {"()": f"{__name__}.SQLiteBusyFlush"}
    recorder = config["loggers"].setdefault(RECORDER_LOGGER, {"level": "${PREFECT_SERVER_LOGGING_LEVEL}"})
    recorder["filters"] = [*recorder.get("filters", []), "sqlite_busy_flush"]
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out
