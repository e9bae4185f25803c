"""Runs that take turns on the machine instead of following one another.

On a shared host whose speed drifts by 10-20 % over tens of seconds, two runs one after another
see different machines, and a ratio of their step times carries the drift. `in_turns` starts
every run at once and lets one run at a time: the others' processes are held with SIGSTOP and
get SIGCONT when their turn comes, every `period_s` seconds. A run's processes are this
process's descendants whose command line holds the run's marker (a path only that run's
processes are given). The step a turn interrupts counts its pause: a few steps in a hundred,
which a median ignores.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import psutil

T = TypeVar("T")


class Turns:
    """Lets one set of this process's descendants run at a time, in turn for `period_s` seconds
    each; the others are held with SIGSTOP. A set is the processes whose command line holds its
    marker; a set leaves the rotation once `done(name)` says so, and `stop` lets everything run."""

    def __init__(self, markers: dict[str, str], period_s: float, done: Callable[[str], bool]) -> None:
        self.markers, self.period_s, self.done = markers, period_s, done
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="turns", daemon=True)
        self._thread.start()

    def _signal_all(self, active: str | None) -> None:
        for proc in psutil.Process().children(recursive=True):
            try:
                line = " ".join(proc.cmdline())
                owner = next((name for name, marker in self.markers.items() if marker in line), None)
                if owner is not None:
                    proc.send_signal(signal.SIGCONT if owner == active or active is None else signal.SIGSTOP)
            except psutil.Error:  # ended meanwhile
                pass

    def _run(self) -> None:
        turn, started = 0, time.monotonic()
        while not self._stop.is_set():
            waiting = [name for name in self.markers if not self.done(name)]
            if not waiting:
                break
            if time.monotonic() - started >= self.period_s:
                turn, started = turn + 1, time.monotonic()
            self._signal_all(waiting[turn % len(waiting)])
            self._stop.wait(0.1)  # processes started meanwhile are held within 0.1 s
        self._signal_all(None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._signal_all(None)


def in_turns(runs: dict[str, tuple[str, Callable[[], T]]], period_s: float) -> dict[str, T]:
    """Every run of `runs` (name -> (marker, the run's function)) at once, on threads, taking
    turns of `period_s` seconds; their results by name. A run's error is raised once every run
    has ended (a failed run leaves the rotation)."""
    out: dict[str, T | BaseException] = {}

    def run(name: str) -> None:
        try:
            out[name] = runs[name][1]()
        except BaseException as exc:  # re-raised below, on the caller's thread
            out[name] = exc

    threads = [threading.Thread(target=run, args=(name,), name=name) for name in runs]
    turns = Turns({name: marker for name, (marker, _) in runs.items()}, period_s, done=lambda name: name in out)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        turns.stop()
    result: dict[str, T] = {}
    for name, value in out.items():
        if isinstance(value, BaseException):
            raise value
        result[name] = value
    return result
