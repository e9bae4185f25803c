"""A slowed node (`elastic inject slow`): the `Throttle` that stops and continues its processes
with real signals (SIGSTOP/SIGCONT), CPU-proportionally with a burner process spinning in each
one's place, or as a plain duty cycle."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from elastic.records.proc_stat import state_and_cpu

_BURNER = (
    "import ctypes, os, sys\n"
    "parent = int(sys.argv[1])\n"
    "ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: it dies with the thread that started it\n"
    "os.write(1, b'r')\n"
    "while os.getppid() == parent:\n"
    "    pass\n"
)
"""A process that spins until its parent is gone (Linux; a stopped one is killed with it too)."""


_TICK_S = 0.005
"""How often the CPU-proportional throttle reads its processes' CPU time."""
_LEAST_REPAY_S = 0.001
"""A repayment stops once less than this is left of it."""
_LEAST_PAUSE_S = 0.01
"""Stop debt below this waits for a later tick: fewer, longer pauses, each of which costs two
rounds of signals."""


class Throttle:
    """Slow processes down with real signals, for `seconds` (or until `stop` is set or `until()`
    holds). `lock` is held while signals are sent and `active` changes, so a hang detector that
    checks under the same lock and skips while `active` never takes the throttling for a hang.

    Two ways, by `hold_cpu`:

    - **CPU-proportional, holding the cores** (`hold_cpu`, what `elastic inject slow` does by
      default): every 5 ms the processes' CPU time is read (their main threads', /proc); each
      CPU second the busiest of them used becomes `factor - 1` seconds stopped (all of them
      together; CPU seconds of their burners, see below, so that on less than a core the stop
      stretches as their computation did), taken while a main thread is running (not while it is blocked on a peer, when
      a stop would cost nothing). So their computation takes
      `factor` times as long and their waiting does not, as on a device `factor` times slower.
      While they are stopped, one burner process per throttled process spins in its place (its
      own SIGSTOP/SIGCONT, in antiphase), so they keep the same share of the host's cores: on a
      host that runs several simulated nodes on fewer cores, the other nodes would otherwise run
      faster for it.
    - **a duty cycle** (without `hold_cpu`): each `period` (50 ms) they run `period / factor`
      seconds and stay stopped the rest, whatever they were doing. A process that spends much of
      a step waiting on peers is slowed less than `factor`, and its host's other processes take
      its share of the cores (a throttle of 2 on one of 4 simulated nodes on 2 cores slowed a job
      of 2 two-stage pipelines to 0.70x). It suits a process whose work is not on the host CPU.
    """

    def __init__(self, pids: Iterable[int], *, factor: float, seconds: float, lock: threading.Lock,
                 period: float = 0.05, hold_cpu: bool = False, cgroup: str = "") -> None:
        if factor <= 1.0:
            raise ValueError(f"factor must be > 1, got {factor}")
        self.pids = list(pids)
        self.cgroup = cgroup
        """The cgroup the processes are in (`elastic run --node-cpus`), which each burner joins ("": none)."""
        self.factor, self.seconds, self.period = factor, seconds, period
        self.lock = lock
        self.hold_cpu = hold_cpu
        self.burners: list[subprocess.Popen[bytes]] = []
        self.active = False
        self.stopped_s = 0.0
        """Wall seconds the processes were stopped."""
        self.repaid_s = 0.0
        """CPU seconds the busiest burner spun in their place (`hold_cpu`): the node's computation
        repaid, whatever share of the cores the host gave it (`stopped_s` stretches with that)."""

    def _signal(self, sig: signal.Signals) -> None:
        """`sig` to each process, and the other one to its burner: the one that stops first, so
        that the two never run at once."""
        anti = signal.SIGCONT if sig == signal.SIGSTOP else signal.SIGSTOP
        for i, pid in enumerate(self.pids):
            burner = self.burners[i] if i < len(self.burners) else None
            if burner is not None and burner.returncode is not None:
                burner = None
            if burner is not None and anti == signal.SIGSTOP:
                burner.send_signal(anti)
            try:
                os.kill(pid, sig)
            except ProcessLookupError:  # gone (a drained node's worker): its burner stops with it
                self._end_burner(i)
                continue
            if burner is not None and anti == signal.SIGCONT:
                burner.send_signal(anti)

    def _start_burners(self) -> None:
        for _ in self.pids:
            burner = subprocess.Popen([sys.executable, "-S", "-c", _BURNER, str(os.getpid())],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
            assert burner.stdout is not None
            burner.stdout.read(1)  # its death signal is set: stopped from now on, it still dies with us
            burner.stdout.close()
            burner.send_signal(signal.SIGSTOP)
            if self.cgroup:  # it spins in their place: in their CPU quota too
                with open(os.path.join(self.cgroup, "cgroup.procs"), "w") as procs:
                    procs.write(str(burner.pid))
            self.burners.append(burner)

    def _end_burner(self, i: int) -> None:
        """Stop the burner of the `i`th process (if it has one still running)."""
        burner = self.burners[i] if i < len(self.burners) else None
        if burner is not None and burner.returncode is None:
            burner.kill()
            burner.wait()

    @contextlib.contextmanager
    def _stopped(self) -> Iterator[None]:
        """The processes stopped (and their burners running) while inside; the time counted in `stopped_s`."""
        with self.lock:
            self.active = True
            self._signal(signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            yield
        finally:
            with self.lock:
                self._signal(signal.SIGCONT)
                self.active = False
            self.stopped_s += time.monotonic() - t0

    def _pause(self, stop: threading.Event, seconds: float) -> None:
        """Stop the processes (and run the burners) for `seconds`, or until `stop` is set."""
        with self._stopped():
            stop.wait(seconds)

    def _duty_cycle(self, stop: threading.Event, end: float, until: Callable[[], bool] | None) -> None:
        run_s = self.period / self.factor
        while time.monotonic() < end and not (until is not None and until()) and not stop.wait(run_s):
            self._pause(stop, min(self.period - run_s, max(0.0, end - time.monotonic())))

    def _proportional(self, stop: threading.Event, end: float, until: Callable[[], bool] | None) -> None:
        def cpu_and_running() -> tuple[dict[int, float], bool]:
            cpu, running = {}, False
            for i, pid in enumerate(self.pids):
                st = state_and_cpu(pid)
                if st is None or st[0] in "ZX":  # gone: its burner stops with it
                    self._end_burner(i)
                else:
                    cpu[pid], running = st[1], running or st[0] == "R"
            return cpu, running

        used, _ = cpu_and_running()
        debt = 0.0
        while time.monotonic() < end and not (until is not None and until()) and not stop.wait(_TICK_S):
            now, running = cpu_and_running()
            # The processes compute side by side (one device each): the busiest one's CPU time is
            # the node's, and all of them are stopped together.
            debt += max((c - used.get(pid, c) for pid, c in now.items()), default=0.0) * (self.factor - 1.0)
            used = now
            if debt >= _LEAST_PAUSE_S and running:
                self._repay(stop, debt, end)
                debt = 0.0

    def _repay(self, stop: threading.Event, debt: float, end: float) -> None:
        """Stop the processes until their burners have spun `debt` CPU seconds (the busiest of them),
        or `end`. In CPU time, not wall time: where the node gets less than a core (a cgroup quota,
        a busy host), its computation took longer than its CPU time, and so does the repayment."""
        start = {b.pid: st[1] for b in self.burners if b.returncode is None and (st := state_and_cpu(b.pid)) is not None}
        if not start:  # every burner is gone with its process: nothing left to slow
            return
        with self._stopped():
            while (left := debt - self._spun(start, default=debt)) > _LEAST_REPAY_S:
                if stop.wait(min(left, max(0.0, end - time.monotonic()))) or time.monotonic() >= end:
                    break
        self.repaid_s += self._spun(start, default=0.0)

    @staticmethod
    def _spun(start: dict[int, float], *, default: float) -> float:
        """CPU seconds the busiest burner spun since `start` (burner pid -> its CPU then)."""
        return max((st[1] - c for pid, c in start.items() if (st := state_and_cpu(pid)) is not None), default=default)

    def _stop_burners(self) -> None:
        for i in range(len(self.burners)):
            self._end_burner(i)
        self.burners.clear()

    def run(self, stop: threading.Event, *, until: Callable[[], bool] | None = None) -> None:
        """Throttle until `seconds` have passed, `until()` holds (asked every few ms) or `stop`
        is set; the processes run on afterwards."""
        end = time.monotonic() + self.seconds
        try:
            if self.hold_cpu:
                self._start_burners()
                self._proportional(stop, end, until)
            else:
                self._duty_cycle(stop, end, until)
        finally:
            with self.lock:
                self._signal(signal.SIGCONT)
                self.active = False
            self._stop_burners()
