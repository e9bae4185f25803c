"""The throttle of `elastic inject slow` holds the node's share of the cores (Throttle's
`hold_cpu`, elastic/records/throttle.py): a burner per throttled process spins exactly while
that process is stopped, and no burner outlives the throttle, not even when the process that
throttles is SIGKILLed. Real processes and signals, sampled with psutil."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from elastic.records.throttle import Throttle
from tests.processes import stop_pids

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]


def _spinner() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-S", "-c", "while True:\n    pass\n"])


def _state(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"


def test_a_burner_runs_exactly_while_its_process_is_stopped() -> None:
    target = _spinner()
    throttle = Throttle([target.pid], factor=2.0, seconds=2.0, lock=threading.Lock(), hold_cpu=True)
    runner = threading.Thread(target=throttle.run, args=(threading.Event(),))
    try:
        runner.start()
        deadline = time.monotonic() + 10
        while not throttle.burners and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(throttle.burners) == 1
        burner = throttle.burners[0].pid
        pairs = []
        while runner.is_alive() and len(pairs) < 200:
            with throttle.lock:  # signals are sent under the lock: a sample sees one phase
                pairs.append((_state(target.pid), _state(burner)))
            time.sleep(0.005)
        runner.join(10)
        stopped = psutil.STATUS_STOPPED
        assert any(t == stopped for t, _ in pairs) and any(t != stopped for t, _ in pairs), pairs
        # A signal takes effect a moment after kill() returns: a sample next to a switch may see
        # both running (or, more rarely, both stopped). Most samples must be in antiphase.
        antiphase = [p for p in pairs if (p[0] == stopped) != (p[1] == stopped)]
        both_stopped = [p for p in pairs if p == (stopped, stopped)]
        assert len(antiphase) >= 0.75 * len(pairs) and len(both_stopped) <= 0.05 * len(pairs), pairs
        assert _state(burner) == "gone" and not throttle.burners
        assert _state(target.pid) != stopped, "the throttled process runs on afterwards"
    finally:
        stop_pids([target.pid])
        target.wait()


def test_burners_die_with_the_process_that_throttles() -> None:
    code = (
        "import os, sys, threading\n"
        "from elastic.records.throttle import Throttle\n"
        "t = Throttle([int(sys.argv[1])], factor=2.0, seconds=60.0, lock=threading.Lock(), hold_cpu=True)\n"
        "threading.Thread(target=t.run, args=(threading.Event(),), daemon=True).start()\n"
        "while not t.burners:\n"
        "    pass\n"
        "print(t.burners[0].pid, flush=True)\n"
        "threading.Event().wait()\n"
    )
    target = _spinner()
    throttler = subprocess.Popen([sys.executable, "-c", code, str(target.pid)], cwd=REPO, stdout=subprocess.PIPE,
                                 text=True)
    burner = None
    try:
        assert throttler.stdout is not None
        burner = int(throttler.stdout.readline())
        assert _state(burner) not in ("gone", psutil.STATUS_ZOMBIE)
        os.kill(throttler.pid, 9)
        throttler.wait(10)
        deadline = time.monotonic() + 5
        while _state(burner) not in ("gone", psutil.STATUS_ZOMBIE) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _state(burner) in ("gone", psutil.STATUS_ZOMBIE), "a burner outlived its throttle"
    finally:
        stop_pids([target.pid, throttler.pid] + ([burner] if burner else []))
        target.wait()
        throttler.wait()


def test_a_burner_stops_when_its_process_is_gone() -> None:
    """A drained node's workers leave while the throttle runs: their burners must not go on
    taking the cores from the job."""
    target = _spinner()
    throttle = Throttle([target.pid], factor=2.0, seconds=20.0, lock=threading.Lock(), hold_cpu=True)
    stop = threading.Event()
    runner = threading.Thread(target=throttle.run, args=(stop,))
    try:
        runner.start()
        deadline = time.monotonic() + 10
        while not throttle.burners and time.monotonic() < deadline:
            time.sleep(0.01)
        burner = throttle.burners[0].pid
        target.kill()
        target.wait()
        deadline = time.monotonic() + 5
        while _state(burner) != "gone" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _state(burner) == "gone", "the burner outlived its process"
        assert runner.is_alive(), "the throttle itself runs to its end"
    finally:
        stop.set()
        runner.join(10)
        stop_pids([target.pid])


_ALTERNATE = """
import sys, time
print("go", flush=True)
computed = slept = 0.0
t_end = time.monotonic() + 3.0
while time.monotonic() < t_end:
    c0, w0 = time.thread_time(), time.monotonic()
    while time.thread_time() - c0 < 0.02:
        pass
    computed += time.monotonic() - w0
    w0 = time.monotonic()
    time.sleep(0.02)
    slept += time.monotonic() - w0
print(computed, slept, flush=True)
"""


def test_the_proportional_throttle_slows_computation_not_waiting() -> None:
    """A process that computes 20 ms of CPU and then sleeps 20 ms, over and over, throttled by 2:
    its computations take about twice as long (their CPU time and as much again stopped), its
    sleeps about as long as asked. A duty cycle would have stopped it during its sleeps too."""
    proc = subprocess.Popen([sys.executable, "-S", "-c", _ALTERNATE], stdout=subprocess.PIPE, text=True)
    stop = threading.Event()
    throttle = Throttle([proc.pid], factor=2.0, seconds=60.0, lock=threading.Lock(), hold_cpu=True)
    runner = threading.Thread(target=throttle.run, args=(stop,))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "go"
        runner.start()
        computed, slept = map(float, proc.stdout.readline().split())
    finally:
        stop.set()
        runner.join(10)
        stop_pids([proc.pid])
        proc.wait()
    rounds = slept / 0.02
    # Each round: 20 ms of CPU, made about 40 ms (the 10 ms ticks of CPU time make it uneven).
    assert 1.5 <= computed / (rounds * 0.02) <= 2.6, (computed, slept)
    assert throttle.stopped_s >= 0.8 * (computed - rounds * 0.02), throttle.stopped_s


def test_a_node_of_two_processes_is_stopped_for_the_busiest_ones_cpu_not_their_sum() -> None:
    """A node's workers compute side by side (one device each): throttled by 2, they are stopped
    as long as the busiest one computed, not as long as both did together."""
    spinners = [_spinner(), _spinner()]
    procs = [psutil.Process(p.pid) for p in spinners]
    throttle = Throttle([p.pid for p in spinners], factor=2.0, seconds=1.5, lock=threading.Lock(), hold_cpu=True)
    try:
        before = [sum(p.cpu_times()[:2]) for p in procs]
        throttle.run(threading.Event())
        used = [sum(p.cpu_times()[:2]) - b for p, b in zip(procs, before, strict=True)]
    finally:
        stop_pids([p.pid for p in spinners])
        for p in spinners:
            p.wait()
    busiest = max(used)
    # In CPU seconds: the stop is repaid in burner CPU, and on a host that gives the node less than
    # a core each (run alone, this test shares the machine with the suite's zygote warming up) the
    # stops stretch in wall time as the computation did (0.77 s stopped for 0.44 + 0.34 CPU s).
    assert 0.6 * busiest <= throttle.repaid_s <= 1.3 * busiest, (throttle.repaid_s, used)
    assert throttle.stopped_s >= 0.9 * throttle.repaid_s, (throttle.stopped_s, throttle.repaid_s)
