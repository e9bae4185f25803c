"""How an elastic run ended: the record `elastic run` writes into its run directory when the job
ends (`<run_dir>/history/end.json`, elastic/ops/run_history.py), and what `elastic status` and
`elastic events` report for a run that is over."""

from __future__ import annotations

from dataclasses import dataclass

from elastic.coordinator.jsonrecord import JsonRecord

ENDINGS = ("finished", "stopped", "failed", "timed out", "interrupted", "terminated", "exited", "crashed",
           "launcher gone")
"""Every `RunEnd.how`: every step committed; stopped on request with a checkpoint (a whole-job
stop: Ctrl-C, SIGTERM, `elastic drain --all`) or returned before the last step; the job failed
(JobFailed); past `--timeout`; stopped at once (a second Ctrl-C, a stop past its grace period);
SIGTERM; another SystemExit; an unexpected error in the launcher; and, written by no launcher,
a run whose launcher died without writing an end (SIGKILL), read back from a copy of its etcd's
data directory."""


@dataclass(frozen=True, kw_only=True)
class RunEnd(JsonRecord):
    """How a run ended."""

    how: str
    """One of ENDINGS."""
    detail: str = ""
    """One line of detail: the failure's message, the signal, or where the history was read from."""
    at: float | None = None
    """Wall time (Unix seconds) of the end, or None where nobody recorded it (`launcher gone`)."""
    launcher_pid: int | None = None
    """PID of the run's launcher (`elastic run`), or None where unknown."""
    source: str = "launcher"
    """Who wrote this account: "launcher" (at the end) or "etcd copy" (read back after a SIGKILL)."""

    def __post_init__(self) -> None:
        if self.how not in ENDINGS:
            raise ValueError(f"RunEnd.how must be one of {ENDINGS}, got {self.how!r}")

    def describe(self) -> str:
        """One line for people: `the run has ended: failed, the leader gave up: ...; 3/6 steps committed`."""
        if self.how == "launcher gone":
            return f"the run has ended without its launcher writing an end (launcher killed?); {self.detail}"
        return f"the run has ended: {self.how}" + (f", {self.detail}" if self.detail else "")
