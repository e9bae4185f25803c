"""How long a stage's own compute took in one step: the seconds of its forward passes, of its
backward passes, and of its waits on peers (issue 33: measure). The straggler detector reads a
node's busy time, forward plus backward (elastic/planning/stragglers.py); waiting is left out,
so a slow node's pipeline mates, which wait for it, do not look slow themselves.

Each computation is timed on the device's own clock:

- **an accelerator** runs kernels asynchronously, so host time around a forward is only its
  launch. Each computation records a pair of timing events on the current stream; `totals` waits
  for the last one and adds their elapsed times. It is read once a step, right before the step's
  vote, whose result the host reads synchronously anyway.
- **the CPU** runs a computation on the calling thread: its wall time, less the time this thread
  was runnable but waited for a core (the kernel's run-queue delay, `/proc/thread-self/schedstat`).
  On one host that runs several simulated nodes (`elastic run` on a laptop), a node's compute is
  otherwise stretched by its neighbours taking the cores in turn, and the stretch depends on how
  much the others compute at the same moment, not on this node's speed. Time the thread was
  stopped (SIGSTOP, `elastic inject slow`) is not run-queue delay: a throttled node is still seen.
  Without schedstat (not Linux), the wall time is used. The two reads cost about 2 us a
  computation (the file stays open for the thread's life). A node given cores of its own
  ($ELASTIC_DEDICATED_CPU=1: `elastic run --node-cpus`, a cgroup quota) is timed by wall time:
  its waits for a core are then its quota running out, i.e. the device being as slow as it is.

A node whose CPU is taken by another process on a CPU device is therefore not counted slow; on
a GPU, the device's clock sees what the device did, whatever the host's load.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from elastic.comm import Handle

_SCHEDSTAT = "/proc/thread-self/schedstat"

DEDICATED_CPU_ENV = "ELASTIC_DEDICATED_CPU"
"""Set to 1 for a worker whose node has cores of its own (module doc): time by wall time."""


STEP_PHASES = ("forward", "backward", "wait")
"""The phases of a step, in the order the vote, the `stragglers` record and the traces list them."""


@dataclass(frozen=True)
class StepPhases:
    """One node's seconds of one step, by phase (0.0 where unmeasured, as in a replayed step)."""

    forward: float = 0.0
    backward: float = 0.0
    wait: float = 0.0
    """Blocked on transfers with pipeline peers (host time)."""

    @property
    def busy(self) -> float:
        """The stage's own compute: forward plus backward."""
        return self.forward + self.backward

    def values(self) -> list[float]:
        """The seconds in `STEP_PHASES` order."""
        return [self.forward, self.backward, self.wait]


class _Schedstat:
    """The calling thread's schedstat file, open for as long as the thread lives (a read is then
    one pread, about 1 us, against 7 us to open it each time)."""

    def __init__(self) -> None:
        try:
            self.fd: int | None = os.open(_SCHEDSTAT, os.O_RDONLY)
        except OSError:
            self.fd = None

    def __del__(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


_THREAD = threading.local()


def run_queue_s() -> float:
    """Seconds the calling thread has waited for a core since it started (0.0 without schedstat)."""
    stat = getattr(_THREAD, "schedstat", None)
    if stat is None:
        stat = _THREAD.schedstat = _Schedstat()
    if stat.fd is None:
        return 0.0
    try:
        return int(os.pread(stat.fd, 64, 0).split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class PhaseClock:
    """Sums the seconds of one step's forward and backward computations (module doc)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host = device.type == "cpu"
        self.wall = os.environ.get(DEDICATED_CPU_ENV) == "1"
        self._sums = {"forward": 0.0, "backward": 0.0}
        self._events: list[tuple[str, torch.Event, torch.Event, float]] = []

    @contextmanager
    def timed(self, phase: str, *, sign: float = 1.0) -> Iterator[None]:
        """Time one computation of `phase` (forward or backward); `sign` -1 takes the span out
        of `phase` instead (`excluded`)."""
        if self.host:
            t0, q0 = time.perf_counter(), 0.0 if self.wall else run_queue_s()
            try:
                yield
            finally:
                waited = 0.0 if self.wall else run_queue_s() - q0
                self._sums[phase] += sign * max(0.0, (time.perf_counter() - t0) - waited)
            return
        import torch  # an accelerator's clock; this module stays importable without torch (`elastic status`)

        start = torch.Event(device=self.device, enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end = torch.Event(device=self.device, enable_timing=True)
            end.record()
            self._events.append((phase, start, end, sign))

    def excluded(self, phase: str) -> contextlib.AbstractContextManager[None]:
        """A wait on peers inside a computation of `phase` (the sharded optimizer's gather,
        waited in a layer's first forward: elastic/engine/param_gather.py), taken out of that
        computation's time by the same clock (on an accelerator, the stream's idle span)."""
        return self.timed(phase, sign=-1.0)

    def totals(self, *, wait: float = 0.0) -> StepPhases:
        """The step's phases so far (an accelerator's events are waited for here), with `wait`."""
        if self._events:
            self._events[-1][2].synchronize()
            for phase, start, end, sign in self._events:
                self._sums[phase] += sign * start.elapsed_time(end) / 1e3
            self._events.clear()
        return StepPhases(forward=max(0.0, self._sums["forward"]), backward=max(0.0, self._sums["backward"]), wait=wait)


class TimedWait:
    """A wait on peers that counts the seconds it blocked (the `wait` phase)."""

    def __init__(self, wait: Callable[[Handle], None]) -> None:
        self.wait, self.seconds = wait, 0.0

    def __call__(self, work: Handle) -> None:
        t0 = time.perf_counter()
        try:
            self.wait(work)
        finally:
            self.seconds += time.perf_counter() - t0
