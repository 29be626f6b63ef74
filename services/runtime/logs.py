"""Logging for every pdserve process: text for people, or one JSON object per line for
log collectors (``--log-format json``). A record's ``request_id`` and ``trace_id`` extras,
when a caller sets them, appear in both."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Protocol

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_EXTRAS = ("request_id", "trace_id")


class LogConfig(Protocol):
    """What ``configure_logging`` reads (``pdserve.settings.process.LogSettings``)."""

    log_level: str
    log_format: str


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, extras, exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in _EXTRAS:
            if hasattr(record, name):
                entry[name] = getattr(record, name)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extras = [f"{n}={getattr(record, n)}" for n in _EXTRAS if hasattr(record, n)]
        return f"{text} [{' '.join(extras)}]" if extras else text


def configure_logging(config: LogConfig) -> None:
    """Send the root logger to stderr at ``config.log_level`` in ``config.log_format``."""
    handler = logging.StreamHandler(sys.stderr)
    if config.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(config.log_level.upper())
