"""The Prefect server's logging, as `mint up` starts it: Prefect's own configuration plus one filter.

On SQLite (the local default), Prefect 3.8's worker-channel heartbeat writes in a deferred transaction: it reads,
then writes, and when another connection committed in between (a flow run's task states, beside the worker's
first poll), SQLite answers "database is locked" at once, whatever its busy timeout. Prefect logs an ERROR with a
traceback, closes the worker's channel, and the worker reconnects: its next heartbeat (every 30 s) is written,
and no flow run is touched (seen in the main job's runs, which all completed beside such errors). The filter
turns that one record into a one-line WARNING that says so; every other record passes as it was. On PostgreSQL
(`prefect_database_url`, the documented scale path) the write takes a row lock and this does not occur.

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


def write_config(prefect_default: Path, out: Path) -> Path:
    """Prefect's logging.yml (its `${...}` settings placeholders kept) with the filter on the heartbeat logger."""
    config: dict[str, Any] = yaml.safe_load(prefect_default.read_text())
    config.setdefault("filters", {})["sqlite_busy_heartbeat"] = {"()": f"{__name__}.SQLiteBusyHeartbeat"}
    config.setdefault("loggers", {})[HEARTBEAT_LOGGER] = {
        "level": "${PREFECT_SERVER_LOGGING_LEVEL}",
        "filters": ["sqlite_busy_heartbeat"],
    }
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out
