"""The phase clock on the CPU (elastic/parallel/phase_clock.py) against the thread's own CPU time:
a computation that shares its core with another process is measured at its CPU time, not at its
stretched wall time; one that is SIGSTOPped is measured with the time it was stopped. Real
processes, real signals, both pinned to one core."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.parallel.phase_clock import DEDICATED_CPU_ENV
from tests.processes import stop_pids

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not Path("/proc/thread-self/schedstat").exists(), reason="needs Linux schedstat")]

REPO = Path(__file__).resolve().parents[2]
CPU_S = 0.6
"""CPU seconds of the timed computation."""

_CHILD = f"""
import json, os, sys, time
os.sched_setaffinity(0, {{int(sys.argv[1])}})
import torch
from elastic.parallel.phase_clock import PhaseClock
clock = PhaseClock(torch.device("cpu"))
print("computing", flush=True)
wall0, cpu0 = time.perf_counter(), time.thread_time()
with clock.timed("forward"):
    while time.thread_time() - cpu0 < {CPU_S}:
        pass
wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
print(json.dumps({{"measured": clock.totals().forward, "cpu": cpu, "wall": wall}}), flush=True)
"""


@pytest.fixture
def core() -> Iterator[int]:
    """One core this test may use (the last one it is allowed on)."""
    yield max(os.sched_getaffinity(0))


def _spin(core: int) -> subprocess.Popen[bytes]:
    code = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"
    return subprocess.Popen([sys.executable, "-S", "-c", code])


def _child(core: int, *, dedicated: bool = False) -> subprocess.Popen[str]:
    env = {**os.environ, DEDICATED_CPU_ENV: "1" if dedicated else "0"}
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(core)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env=env)


def _result(child: subprocess.Popen[str]) -> dict[str, float]:
    assert child.stdout is not None
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("dedicated", [False, True])
def test_time_waiting_for_a_shared_core_is_not_counted(core: int, dedicated: bool) -> None:
    """...unless the node's cores are its own (`--node-cpus`): a wait for one is then the node's
    quota running out, and the wall time is the device's time."""
    hog = _spin(core)
    child = _child(core, dedicated=dedicated)
    try:
        got = _result(child)
    finally:
        stop_pids([hog.pid, child.pid])
        hog.wait()
    assert got["wall"] >= 1.5 * got["cpu"], f"the core was not shared: {got}"
    expected = got["wall"] if dedicated else got["cpu"]
    assert abs(got["measured"] - expected) <= 0.15 * expected + 0.01, got


def test_time_stopped_by_sigstop_is_counted(core: int) -> None:
    child = _child(core)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "computing"
        time.sleep(0.1)
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.4)
        os.kill(child.pid, signal.SIGCONT)
        got = _result(child)
    finally:
        stop_pids([child.pid])
    assert got["measured"] >= got["cpu"] + 0.35, got
    assert got["measured"] <= got["wall"] + 0.01, got
