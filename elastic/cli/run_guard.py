"""What `elastic run` does around its job: it claims the run directory, checks the port it was
told to listen on, and records the job's history when the job ends.

- The run directory is claimed with `RunDirLock` (elastic/ops/run_lock.py) for the life of this
  process: a second `elastic run --run-dir R` while a live one uses R exits 2 at once, naming the
  pid that holds it; a lock left by a dead launcher does not count. An orderly exit releases it.
- `$ELASTIC_METRICS_PORT` (the one port `elastic run` is told to listen on; etcd, the rendezvous
  store and the shard servers pick free ports) must be free on `bind_host()`: a clash exits 2
  with one line naming the holder, not a warning buried in each agent's log.
- `RunGuard.record_history` is the launcher's `before_etcd_stops` hook: with the job's processes
  stopped and its etcd still up, it writes the job's events, last status and how the run ended
  into `<run_dir>/history/` (elastic/ops/run_history.py), however the run ended (it runs inside
  the launcher's `finally`, where the exception in flight says how).
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from elastic.cli.main import UsageError
from elastic.coordinator.client import stop_retrying
from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.keys import JobKeys
from elastic.coordinator.netaddr import bind_host
from elastic.ops.metrics import PORT_ENV
from elastic.ops.run_history import save_history, snapshot
from elastic.ops.run_lock import RunDirInUse, RunDirLock
from elastic.ops.status import JobStatus
from elastic.records.run_end import RunEnd
from elastic.records.stop import BY_WORDS

_held: list[RunDirLock] = []
"""The run directory this process holds: one `elastic run` at a time per process, so a lock left
by an earlier in-process run (tests call `main()`) is released before the next is taken."""


@dataclass(kw_only=True)
class RunGuard:
    """The claimed run directory of one `elastic run`."""

    run_dir: Path
    """The run directory."""
    lock: RunDirLock
    """Its lock, held until this process exits (or runs again)."""

    def record_history(self, client: EtcdClient, keys: JobKeys, etcd: str) -> None:
        """Write the job's history and how it ended into the run directory (module doc); never
        raises: a failure costs the history (one warning line), not the run's own outcome."""
        in_flight = sys.exc_info()[1]
        try:
            stop_retrying(client)  # the job is over: an etcd that does not answer now is not waited on
            events, status = snapshot(client, keys, etcd=etcd)
            save_history(self.run_dir, events=events, status=status, end=ending(in_flight, status))
        except (Exception, KeyboardInterrupt) as exc:
            print(f"elastic run: warning: the job's history was not saved in {self.run_dir}: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def guard_run(run_dir: Path, *, embedded_etcd: bool, local_agents: bool) -> RunGuard:
    """Claim `run_dir` and check the metrics port (UsageError, one line, if either fails). The
    history an earlier run left there stays until this run writes its own (a run that does not
    start leaves the earlier one readable); readers tell them apart by the lock's record."""
    _release_held()  # an earlier run of this process has ended
    if local_agents:
        check_metrics_port()
    try:
        lock = RunDirLock.acquire(run_dir, embedded_etcd=embedded_etcd)
    except RunDirInUse as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot use run dir {run_dir}: {exc.strerror}") from None
    _held.append(lock)
    return RunGuard(run_dir=run_dir, lock=lock)


def _release_held() -> None:
    while _held:
        _held.pop().release()


atexit.register(_release_held)  # an orderly exit (return, exception, SIGTERM's SystemExit) lets go of the run dir


def check_metrics_port() -> None:
    """UsageError unless `$ELASTIC_METRICS_PORT` (when set, not 0) is a port this host can listen
    on now (module doc)."""
    raw = os.environ.get(PORT_ENV, "").strip()
    if raw in ("", "0"):
        return
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise UsageError(f"${PORT_ENV}={raw!r} is not a port number")
    try:
        host = bind_host()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    port = int(raw)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the metrics server binds
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise UsageError(
                f"cannot serve metrics on {host}:{port} (${PORT_ENV}): {exc.strerror}{_holder(port)}; "
                f"free that port, or unset ${PORT_ENV} (each agent then takes a free one)"
            ) from None


def _holder(port: int) -> str:
    """` (pid N, NAME)` of the process listening on TCP `port`, where this user may see it."""
    import psutil

    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                return f" (pid {conn.pid}, {psutil.Process(conn.pid).name()})"
    except (psutil.Error, OSError):
        pass
    return ""


def ending(exc: BaseException | None, status: JobStatus) -> RunEnd:
    """How the run ended, from the exception that ends it (None: the launcher returned) and the
    job's last status."""
    total = "?" if status.total_steps is None else str(status.total_steps)
    steps = f"{status.committed_steps}/{total} steps committed"
    how, why = _classify(exc, status)
    return RunEnd(how=how, detail=f"{why}; {steps}" if why else steps, at=time.time(), launcher_pid=os.getpid())


def _classify(exc: BaseException | None, status: JobStatus) -> tuple[str, str]:
    """(RunEnd.how, the reason in a few words)."""
    from elastic.roles.interrupt import Interrupted
    from elastic.roles.job_stop import JobStopped, StopTimedOut
    from elastic.roles.launch_errors import JobFailed, StartupError, WorkerFailed

    if isinstance(exc, Interrupted):  # a signal's stop at once, raised where the launcher could: as the signal's own
        exc = exc.unwound()
    if exc is None:
        done = status.total_steps is not None and status.committed_steps >= status.total_steps
        return ("finished", "") if done else ("stopped", "the launcher returned before the last step")
    first = str(exc).strip().splitlines()[0].rstrip(":") if str(exc).strip() else ""
    if isinstance(exc, JobStopped):  # a whole-job stop that saved (elastic/cli/run_stop.py)
        by = BY_WORDS.get(exc.outcome.by, exc.outcome.by)
        return "stopped", f"on request ({by}) at step {exc.outcome.step}, with its checkpoint"
    if isinstance(exc, StopTimedOut):
        return "interrupted", first
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", "Ctrl-C"
    if isinstance(exc, SystemExit):
        if exc.code == 128 + signal.SIGTERM:
            return "terminated", "SIGTERM"
        return "exited", f"exit code {exc.code}"
    if isinstance(exc, (JobFailed, WorkerFailed, StartupError)):
        return "failed", first
    if isinstance(exc, TimeoutError):
        return "timed out", first
    return "crashed", f"{type(exc).__name__}: {first}" if first else type(exc).__name__
