"""What a launch raises when a job cannot start or finish: `elastic run` maps each to its exit
code and message (elastic/cli/run_guard.py)."""

from __future__ import annotations


class WorkerFailed(RuntimeError):
    """A worker exited with a non-zero code; every other worker has been stopped."""


class JobFailed(RuntimeError):
    """An elastic job could not finish (no progress possible, or the leader gave up)."""


class StartupError(RuntimeError):
    """The job could not start: one line naming what failed and what to check (`elastic run`
    exits 2)."""
