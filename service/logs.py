"""Logging set-up for `lmgate serve`: plain lines for a terminal, or one JSON object per line for shippers."""

from __future__ import annotations

import json
import logging
import time


class JsonFormatter(logging.Formatter):
    """`{"time", "level", "logger", "message"}`, plus the record's `fields` (the access log's) and any
    exception's text."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(level: str, fmt: str) -> None:
    """Root logging at `level`, in `fmt` ("text" or "json"), on stderr."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
