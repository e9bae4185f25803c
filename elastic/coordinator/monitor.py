"""Failure detection on the node: notice a local worker's death at once and report it.

`WorkerMonitor` holds a pidfd per worker (Linux >= 5.3) and blocks in poll(): the kernel wakes
it the moment a worker exits, SIGKILL included, with no polling interval to wait out. Where
pidfds are unavailable it falls back to psutil every `fallback_interval` seconds.
`watch_workers(membership, pids)` wires a monitor to `Membership.report_failure`, which
revokes the node's lease, so every other member's watch sees the loss within milliseconds.

The other direction, `die_with_parent(agent_pid)`: a worker whose agent is SIGKILLed would
otherwise live on as an orphan, unmonitored, until its peers' next reconfiguration or forever;
with it the kernel SIGKILLs the worker the moment the agent dies.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterable

import psutil

from .membership import Membership

log = logging.getLogger(__name__)


class WorkerMonitor:
    """Calls `on_death(pid)` once for each watched process that exits."""

    def __init__(
        self, pids: Iterable[int], on_death: Callable[[int], None], *, fallback_interval: float = 0.05
    ) -> None:
        self._on_death = on_death
        self._fallback_interval = fallback_interval
        self._stop_r, self._stop_w = os.pipe()
        self._stopped = False
        self._fds: dict[int, int] = {}  # fd -> pid
        self._procs: dict[int, psutil.Process] = {}  # pid -> process (fallback path)
        for pid in pids:
            self._add(pid)
        self._thread = threading.Thread(target=self._run, name="worker-monitor", daemon=True)
        self._thread.start()

    def _add(self, pid: int) -> None:
        try:
            self._fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            self._fds[-pid - 1] = pid  # already gone: report at once
        except (AttributeError, OSError):
            try:
                self._procs[pid] = psutil.Process(pid)
            except psutil.NoSuchProcess:
                self._fds[-pid - 1] = pid

    def stop(self) -> None:
        """Stop watching; no callback runs after this returns (except one already running)."""
        if self._stopped:
            return
        self._stopped = True
        os.write(self._stop_w, b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)
            os.close(self._stop_r)
            os.close(self._stop_w)

    def _run(self) -> None:
        try:
            for fd in [fd for fd in self._fds if fd < 0]:
                self._on_death(self._fds.pop(fd))
            poller = select.poll()
            poller.register(self._stop_r, select.POLLIN)
            for fd in self._fds:
                poller.register(fd, select.POLLIN)
            timeout_ms = int(self._fallback_interval * 1000) if self._procs else None
            while self._fds or self._procs:
                ready = poller.poll(timeout_ms)
                if any(fd == self._stop_r for fd, _ in ready):
                    return
                for fd, _ in ready:
                    poller.unregister(fd)
                    pid = self._fds.pop(fd)
                    os.close(fd)
                    self._on_death(pid)
                for pid, proc in list(self._procs.items()):
                    try:
                        dead = not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
                    except psutil.NoSuchProcess:
                        dead = True
                    if dead:
                        del self._procs[pid]
                        self._on_death(pid)
        except Exception:
            log.exception("worker monitor failed")
        finally:
            for fd in self._fds:
                if fd >= 0:
                    os.close(fd)
            self._fds.clear()


def watch_workers(membership: Membership, pids: Iterable[int]) -> WorkerMonitor:
    """Report this node failed (lease revoked) as soon as any of its workers dies."""
    fired = threading.Event()

    def on_death(pid: int) -> None:
        if fired.is_set():
            return
        fired.set()
        membership.report_failure(reason=f"worker pid {pid} exited")

    return WorkerMonitor(pids, on_death)


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process as soon as `parent_pid` (the agent that started it) dies; at once if
    it already has.

    When the agent is our parent (a fresh interpreter it started), Linux's PR_SET_PDEATHSIG: the
    kernel delivers it when the parent *thread* that forked us exits, so the parent must spawn
    from a thread that lives as long as it does (the agent's main thread). When a warm parent
    forked us for the agent (elastic/roles/zygote.py), the agent is not our parent: a
    `WorkerMonitor` of the agent (a pidfd the kernel makes readable the moment it exits; psutil
    polling where there are no pidfds) kills us.
    """
    if os.getppid() == parent_pid and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() == parent_pid:
            return
    elif psutil.pid_exists(parent_pid):
        WorkerMonitor([parent_pid], lambda pid: os.kill(os.getpid(), signal.SIGKILL))
        return
    log.warning("parent %d is gone; exiting", parent_pid)  # it died before the watch took effect
    os.kill(os.getpid(), signal.SIGKILL)

