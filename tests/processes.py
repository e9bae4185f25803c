"""Run spawned worker processes with a deadline, and always stop them by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from multiprocessing.process import BaseProcess


def stop_pids(pids: list[int]) -> None:
    """SIGKILL every still-running PID of the list (a stopped process dies too)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def run_processes(procs: list[BaseProcess], *, timeout: float) -> None:
    """Start `procs`, wait for all of them, fail unless every one exits 0; never leaks one."""
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [p.pid for p in procs if p.is_alive()]
        if hung:
            raise AssertionError(f"worker processes {hung} did not finish within {timeout} s")
        failed = {p.pid: p.exitcode for p in procs if p.exitcode != 0}
        if failed:
            raise AssertionError(f"worker processes exited with non-zero codes: {failed}")
    finally:
        stop_pids([p.pid for p in procs if p.pid is not None and p.is_alive()])
        for p in procs:
            if p.pid is not None:
                p.join(5)
