"""`elastic events` and `elastic status` on a run that has ended, on real `elastic run` processes
and real signals: the events `elastic events --json --run-dir R` printed while the run was live
are printed again, identical and in the same order, once it has ended, whether its launcher
finished, was stopped with SIGTERM, or was SIGKILLed (then nothing was written at the end and
the history is read back from a copy of R/etcd); one `ended` event follows them, and `elastic
status` says that the run has ended and how. A second `elastic run` on the live run's directory
exits 2 at once, naming the live launcher's pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from elastic.coordinator import EtcdConfig, connect
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.records.progress import read_progress
from tests.polling import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ELASTIC = [sys.executable, "-m", "elastic.cli"]
RUN = ["run", "--model", "tiny", "--nodes", "2", "--global-batch", "8", "--microbatch", "2", "--device", "cpu",
       "--no-report"]
LIVE_STEPS = 3
"""Steps committed before the live history is read."""


@dataclass
class Launcher:
    """One `elastic run` subprocess and what the test saw of it."""

    proc: subprocess.Popen[bytes]
    run_dir: Path
    out: Path
    job: str = ""
    pids: set[int] = field(default_factory=set)
    """The job's agents and workers, seen while it ran (for the clean-up)."""

    def output(self) -> str:
        return self.out.read_text(errors="replace")


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ELASTIC, *args], capture_output=True, text=True, timeout=timeout)


def events_json(run_dir: Path) -> list[dict[str, Any]]:
    out = cli("events", "--json", "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def status_json(run_dir: Path) -> dict[str, Any]:
    out = cli("status", "--json", "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def _job_pids(job: str) -> set[int]:
    """Live processes whose command line names the job (agents and workers carry `--job ID`)."""
    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if job in (proc.info["cmdline"] or []) and proc.status() != psutil.STATUS_ZOMBIE:
                found.add(proc.pid)
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Any]:
    """Starts `elastic run` with the given steps in a run dir of its own; kills what is left, by PID."""
    started: list[Launcher] = []

    def _start(steps: int) -> Launcher:
        run_dir = tmp_path / f"run{len(started)}"
        out = tmp_path / f"run{len(started)}.out"
        with open(out, "wb") as sink:
            proc = subprocess.Popen([*ELASTIC, *RUN, "--steps", str(steps), "--run-dir", str(run_dir)],
                                    stdout=sink, stderr=subprocess.STDOUT,
                                    env={**os.environ, "ELASTIC_ETCD_GIVE_UP_S": "2"})
        started.append(Launcher(proc=proc, run_dir=run_dir, out=out))
        return started[-1]

    yield _start
    for launcher in started:
        if launcher.proc.poll() is None:
            launcher.proc.kill()
            launcher.proc.wait()
        left = [psutil.Process(pid) for pid in launcher.pids if psutil.pid_exists(pid)]
        for proc in left:
            proc.kill()
        psutil.wait_procs(left, timeout=10)


def wait_live(launcher: Launcher) -> list[dict[str, Any]]:
    """Once LIVE_STEPS steps are committed: the history `elastic events --json` prints of the live run."""
    job_file = launcher.run_dir / "job.json"
    job_json = wait_for(lambda: job_file.exists() and json.loads(job_file.read_text()), 90, "job.json")
    launcher.job = job_json["job"]
    client = connect(EtcdConfig(endpoint=job_json["etcd"]))
    try:
        rk = RunKeys(JobKeys(launcher.job))

        def committed() -> bool:
            assert launcher.proc.poll() is None, launcher.output()
            record = read_progress(client, rk)
            return record is not None and record.step + 1 >= LIVE_STEPS

        wait_for(committed, 120, f"{LIVE_STEPS} committed steps")
    finally:
        client.close()
    launcher.pids = _job_pids(launcher.job)
    live = events_json(launcher.run_dir)
    assert "ended" not in [e["kind"] for e in live], "the run ended before its live history was read: raise its steps"
    assert {"join", "generation"} <= {e["kind"] for e in live}, live
    return live


def check_ended(launcher: Launcher, live: list[dict[str, Any]], how: str) -> dict[str, Any]:
    """The ended run's events repeat the live ones, then say how it ended; its status too. The
    ended run's `ended` event."""
    after = events_json(launcher.run_dir)
    assert after[: len(live)] == live, "an event seen live differs, or went missing, once the run ended"
    ended = after[-1]
    assert ended["kind"] == "ended" and ended["detail"]["how"] == how, ended
    assert all(e["kind"] != "ended" for e in after[:-1])
    status = status_json(launcher.run_dir)
    assert status["ended"]["how"] == how and status["job"] == launcher.job, status["ended"]
    assert status["committed_steps"] >= LIVE_STEPS
    assert all(not n["alive"] for n in status["nodes"]), status["nodes"]
    table = cli("status", "--run-dir", str(launcher.run_dir))
    assert table.returncode == 0 and table.stdout.startswith("the run has ended"), table.stdout
    text = cli("events", "--run-dir", str(launcher.run_dir))
    assert text.returncode == 0 and "ended" in text.stdout.splitlines()[-1], text.stdout
    print(f"{how}: {len(live)} events live, {len(after)} after the end; {table.stdout.splitlines()[0]}")
    detail: dict[str, Any] = ended["detail"]
    return detail


def test_a_finished_run_keeps_its_history(start: Any) -> None:
    launcher = start(steps=40)
    live = wait_live(launcher)
    assert status_json(launcher.run_dir)["ended"] is None  # live: read from the job's etcd
    assert launcher.proc.wait(timeout=180) == 0, launcher.output()
    detail = check_ended(launcher, live, "finished")
    assert detail["detail"] == "40/40 steps committed" and detail["source"] == "launcher"
    assert detail["launcher_pid"] == launcher.proc.pid
    assert sorted(p.name for p in (launcher.run_dir / "history").iterdir()) == ["end.json", "events.json",
                                                                                "status.json"]
    assert not (launcher.run_dir / "launcher.lock").exists()  # released at the orderly end
    assert status_json(launcher.run_dir)["state"] == "finished"


def test_a_sigterm_stopped_run_keeps_its_history(start: Any) -> None:
    launcher = start(steps=1000)
    live = wait_live(launcher)
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(timeout=120) == 128 + signal.SIGTERM, launcher.output()
    how = events_json(launcher.run_dir)[-1]["detail"]["how"]
    assert how in ("stopped", "terminated"), how  # a stop that saves at a step boundary, or at once
    detail = check_ended(launcher, live, how)
    assert "SIGTERM" in detail["detail"] and detail["launcher_pid"] == launcher.proc.pid


def test_a_sigkilled_run_keeps_its_history_in_its_etcd_data(start: Any) -> None:
    launcher = start(steps=1000)
    live = wait_live(launcher)

    began = time.monotonic()  # the run dir is taken: a second launcher is refused at once
    second = subprocess.run([*ELASTIC, *RUN, "--steps", "2", "--run-dir", str(launcher.run_dir)],
                            capture_output=True, text=True, timeout=60)
    refused_s = time.monotonic() - began
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert f"run dir {launcher.run_dir} is in use by a live elastic run (pid {launcher.proc.pid})" in lines[0]
    print(f"second launcher refused in {refused_s:.1f} s: {lines[0]}")
    assert launcher.proc.poll() is None  # and the live run goes on

    launcher.proc.send_signal(signal.SIGKILL)
    launcher.proc.wait()
    began = time.monotonic()
    detail = check_ended(launcher, live, "launcher gone")
    print(f"read back from a copy of its etcd data in {time.monotonic() - began:.1f} s (events, status, text)")
    assert detail["source"] == "etcd copy" and detail["launcher_pid"] == launcher.proc.pid
    table = cli("status", "--run-dir", str(launcher.run_dir)).stdout
    assert "without its launcher writing an end (launcher killed?)" in table.splitlines()[0], table
    assert not (launcher.run_dir / "history").exists()  # readers write nothing into the run dir
