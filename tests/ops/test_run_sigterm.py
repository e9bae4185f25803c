"""`elastic run` stopped with SIGTERM (a scheduler, `timeout`) stops every process of its job;
SIGKILLed, its agents see it go and stop their nodes at once; with its etcd gone, they give up
on etcd and leave."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import psutil
import pytest

from tests.polling import wait_for

pytestmark = pytest.mark.slow


def _job_processes(job: str) -> list[psutil.Process]:
    """Live processes whose command line names the job (agents and workers carry `--job ID`)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if job in (proc.info["cmdline"] or []) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


def _start(run_dir: Path, env: dict[str, str] | None = None, extra: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "elastic.cli.main", "run", "--model", "tiny", "--nodes", "3",
           "--fault-tolerance", "1", "--steps", "1000", "--run-dir", str(run_dir), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _training(run_dir: Path) -> str:
    """The job id, once a worker of every node is up (3 agents + 3 workers carry the job id)."""
    job_file = run_dir / "job.json"
    job: str = wait_for(lambda: job_file.exists() and json.loads(job_file.read_text())["job"], 60, "job.json")
    wait_for(lambda: len(_job_processes(job)) >= 6, 60, "the job's agents and workers")
    return job


def _clean_up(launcher: subprocess.Popen[str], job: str) -> None:
    """Kill what a failed test left: the launcher, then every process of the job, by PID."""
    if launcher.poll() is None:
        launcher.kill()
        launcher.wait()
    for proc in _job_processes(job) if job else []:
        proc.kill()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra", [(), ("--checkpoint-every", "0")], ids=["saves", "nothing-to-save"])
def test_sigterm_stops_every_process_of_the_job(tmp_path: Path, extra: tuple[str, ...]) -> None:
    """With checkpoints, SIGTERM asks the stop that saves (tests/faults/test_stop_save.py has its
    checkpoint); without, it stops at once: the launcher raises it from its loop
    (elastic/roles/interrupt.py). Either way the job's processes are gone and the exit is 143."""
    run_dir = tmp_path / "run"
    launcher = _start(run_dir, extra=extra)
    job = ""
    try:
        job = _training(run_dir)
        launcher.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # a second SIGTERM (`timeout` and a scheduler both sending one) during the cleanup
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=30)
        assert launcher.returncode == 128 + signal.SIGTERM, out
        assert "terminated (SIGTERM)" in out
        left = _job_processes(job)
        assert not left, f"processes of job {job} outlived the launcher: {[p.pid for p in left]}"
    finally:
        _clean_up(launcher, job)


@pytest.mark.timeout(120)
def test_a_sigkilled_launchers_agents_and_workers_stop_at_once(tmp_path: Path) -> None:
    """SIGKILL the launcher: every agent sees it go (elastic/roles/launcher_watch.py), kills its
    workers and exits, whoever its parent is (in the suite, the session's shared warm parent: a
    CI run's agents outlived a launcher killed at a test's timeout, and their workers spun for
    minutes)."""
    run_dir = tmp_path / "run"
    launcher = _start(run_dir)
    job = ""
    try:
        job = _training(run_dir)
        orphans = _job_processes(job)
        launcher.kill()
        launcher.wait()
        killed_at = time.monotonic()
        _, alive = psutil.wait_procs(orphans, timeout=30)
        assert not alive, f"processes of job {job} still there 30 s after the launcher: {[p.pid for p in alive]}"
        print(f"{len(orphans)} processes of the job gone {time.monotonic() - killed_at:.1f} s after the launcher")
        logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("agent*.log"))
        assert f"the launcher (pid {launcher.pid}) is gone" in logs, logs[-2000:]
    finally:
        _clean_up(launcher, job)


@pytest.mark.timeout(150)
def test_agents_leave_when_etcd_is_gone(tmp_path: Path) -> None:
    """SIGKILL the job's etcd, the launcher left alive: every agent finds etcd unreachable, gives
    up after $ELASTIC_ETCD_GIVE_UP_S, stops its workers and exits (before: they retried forever)."""
    run_dir = tmp_path / "run"
    launcher = _start(run_dir, env={**os.environ, "ELASTIC_ETCD_GIVE_UP_S": "2"})
    job = ""
    try:
        job = _training(run_dir)
        agents = [p for p in _job_processes(job) if "elastic.roles.agent" in " ".join(p.cmdline())]
        etcd = [p for p in psutil.Process(launcher.pid).children(recursive=True) if p.name() == "etcd"]
        assert len(agents) == 3 and len(etcd) == 1, (agents, etcd)
        etcd[0].kill()
        gone_at = time.monotonic()
        _, alive = psutil.wait_procs(agents, timeout=60)
        assert not alive, f"agents of job {job} still there 60 s after etcd went: {[p.pid for p in alive]}"
        print(f"{len(agents)} agents gone {time.monotonic() - gone_at:.1f} s after etcd")
        logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("agent*.log"))
        assert "etcd unreachable for" in logs, logs[-2000:]
    finally:
        _clean_up(launcher, job)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_at_once_is_only_asked_while_the_launcher_runs(signum: int) -> None:
    """`elastic run`'s handlers, in this process with real signals: while `launch_elastic` runs
    (Interrupt.live) a stop at once raises nothing where the signal lands (it could land inside a
    gRPC lock: interrupt.py) and is recorded for the launcher; outside, it raises what the signal
    means (KeyboardInterrupt, or SystemExit 128 + the signal). Either way, later signals are ignored."""
    from elastic.cli.run_stop import stop_on_signals
    from elastic.roles.interrupt import Interrupt, Interrupted

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    nothing_to_save = SimpleNamespace(checkpoint_every=0)
    try:
        interrupt = Interrupt(live=True)
        assert stop_on_signals(nothing_to_save, interrupt) is None
        os.kill(os.getpid(), signum)
        wait_for(lambda: interrupt.signum is not None, 5.0, "the handler to run")
        os.kill(os.getpid(), signal.SIGINT if signum != signal.SIGINT else signal.SIGTERM)  # ignored now
        time.sleep(0.1)
        assert interrupt.signum == signum
        with pytest.raises(Interrupted) as raised:
            interrupt.check()
        expected = KeyboardInterrupt if signum == signal.SIGINT else SystemExit
        assert isinstance(raised.value.unwound(), expected)

        outside = Interrupt()
        stop_on_signals(nothing_to_save, outside)
        with pytest.raises(expected) as unwound:
            os.kill(os.getpid(), signum)
            time.sleep(1.0)  # the handler raises here
        if expected is SystemExit:
            assert cast(SystemExit, unwound.value).code == 128 + signum
        assert outside.signum is None
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
