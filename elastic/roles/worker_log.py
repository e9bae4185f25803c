"""An elastic worker's log lines: one timestamped line on stderr each, which its agent sends to
the worker's log file (elastic/roles/agent.py `worker_log_path`)."""

from __future__ import annotations

import sys
import time


def worker_log(message: str) -> None:
    """Write `message` to this worker's log, stamped with the wall-clock time."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
