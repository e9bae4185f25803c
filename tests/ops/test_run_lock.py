"""The run directory's lock (elastic/ops/run_lock.py) between real processes: a live holder
refuses a second launcher, naming its pid; a SIGKILLed holder's stale file blocks nobody (and
its record says whose it was); an orderly release removes the file, and a directory the lock
created when nothing else was written there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.ops.run_lock import LOCK_FILE, RunDirInUse, RunDirLock, probe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

HOLD = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from elastic.ops.run_lock import RunDirLock\n"
    "RunDirLock.acquire(Path(sys.argv[1]), embedded_etcd=True)\n"
    "print('held', flush=True)\n"
    "time.sleep(120)\n"
)
"""A process that takes the run directory of argv[1] and holds it until killed."""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_live_holder_refuses_a_second_launcher_naming_its_pid(tmp_path: Path,
                                                                  holder: subprocess.Popen[str]) -> None:
    run_dir = tmp_path / "run"
    state = probe(run_dir)
    assert state is not None and state.held and state.record is not None and state.record.pid == holder.pid
    with pytest.raises(RunDirInUse, match=f"in use by a live elastic run \\(pid {holder.pid}\\)") as refused:
        RunDirLock.acquire(run_dir, embedded_etcd=True)
    assert refused.value.pid == holder.pid
    assert probe(run_dir) == state  # the refused attempt changed nothing


def test_a_killed_holders_lock_is_stale_and_blocks_nobody(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    run_dir = tmp_path / "run"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    state = probe(run_dir)
    assert state is not None and not state.held and state.record is not None and state.record.pid == holder.pid
    lock = RunDirLock.acquire(run_dir, embedded_etcd=False)  # the stale file is taken over
    state = probe(run_dir)
    assert state is not None and state.held and state.record is not None
    assert (state.record.pid, state.record.embedded_etcd) == (os.getpid(), False)
    lock.release()
    assert not (run_dir / LOCK_FILE).exists() and run_dir.exists()  # the holder created the dir, not this lock
    assert probe(run_dir) is None


def test_release_leaves_no_trace_of_a_refused_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "never"
    RunDirLock.acquire(run_dir, embedded_etcd=True).release()
    assert not run_dir.exists()
    kept = tmp_path / "kept"
    lock = RunDirLock.acquire(kept, embedded_etcd=True)
    (kept / "job.json").write_text("{}")
    lock.release()
    assert sorted(p.name for p in kept.iterdir()) == ["job.json"]
