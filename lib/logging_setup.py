"""Structured (JSON-lines) logs for the daemons: one object per record, extras included."""
from __future__ import annotations

import faulthandler
import json
import logging
import sys
import time

_STD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(time.time(), 3), "level": record.levelname, "logger": record.name,
               "msg": record.getMessage()}
        out.update({k: v for k, v in vars(record).items() if k not in _STD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(level: str = "INFO") -> None:
    """JSON logs on stderr, and Python tracebacks of every thread on a native crash (faulthandler),
    so a daemon that dies in C leaves evidence in its log."""
    faulthandler.enable(sys.stderr, all_threads=True)
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(level)
