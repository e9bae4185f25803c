"""A stop at once asked by a signal while `launch_elastic` runs, carried out by the launcher itself.

A signal handler that raises does so between two bytecodes of whatever the main thread runs. In
gRPC's Python layer that can be after a call's lock is taken and before the `try` that releases
it: the lock stays taken, gRPC's channel thread then waits on it for good, and every later call
on the channel hangs, the launcher's cleanup first (seen: deploy/netns/launch.py's SIGTERM hung
60 s in a watch's cancel). So while `launch_elastic` runs (`Interrupt.live`), a handler only
records the signal; the launcher checks it between its start's steps and on each turn of its
loop (every 0.25 s at most, run_loop.py), and raises `Interrupted` there, where no lock is
held. Its usual cleanup then stops every process by PID. Outside `launch_elastic` a handler may
raise as before: nothing there talks to etcd.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass


class Interrupted(Exception):
    """Raised by `launch_elastic` at a safe point once a signal asked to stop at once."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    def unwound(self) -> BaseException:
        """What the signal's handler would have raised outside `launch_elastic`: KeyboardInterrupt
        for SIGINT, SystemExit(128 + the signal) for the others."""
        if self.signum == signal.SIGINT:
            return KeyboardInterrupt()
        return SystemExit(128 + self.signum)


@dataclass(kw_only=True)
class Interrupt:
    """Plain attributes, no lock and no I/O: a handler may set them whatever the main thread does."""

    live: bool = False
    """True while `launch_elastic` runs: a handler then calls `ask` and returns, and must not raise."""
    signum: int | None = None
    """The first signal that asked (None: not asked)."""

    def ask(self, signum: int) -> None:
        """Record a stop at once (the first signal stands)."""
        if self.signum is None:
            self.signum = signum

    def stop_at_once(
        self, signum: int, *, ignore: Iterable[int],
        outside: Callable[[Interrupted], BaseException] = Interrupted.unwound,
    ) -> None:
        """A stopping signal's handler: ignore the signals `ignore` from now on (nothing may cut
        the cleanup short), then `ask` while the launcher runs, else raise `outside` of it (by
        default what the signal would have raised: `Interrupted.unwound`)."""
        for sig in ignore:
            signal.signal(sig, signal.SIG_IGN)
        if self.live:
            self.ask(signum)
            return
        raise outside(Interrupted(signum))

    def check(self) -> None:
        """Raise `Interrupted` once asked; called by the launcher where no lock is held."""
        if self.signum is not None:
            raise Interrupted(self.signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """`live` for the block (`launch_elastic`'s run), then Interrupted if a signal asked meanwhile,
        its cleanup included; what the block raises goes on unchanged."""
        self.live = True
        try:
            yield
        finally:
            self.live = False
        self.check()
