"""A workflow history saved as JSON (``temporal workflow show --output json``, or ``.json.gz``), read back
for replay under the workflow id it was recorded with: child workflow ids derive from it, so replaying
under another id is a nondeterminism error."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from temporalio.client import WorkflowHistory


def read_history(path: Path) -> WorkflowHistory:
    raw = path.read_bytes()
    text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode()
    started = (json.loads(text).get("events") or [{}])[0].get("workflowExecutionStartedEventAttributes", {})
    return WorkflowHistory.from_json(started.get("workflowId") or path.name.split(".")[0], text)
