"""`elastic run` stopped with SIGTERM (a scheduler, `timeout`) stops every process of its job."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.polling import wait_for


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


@pytest.mark.timeout(120)
def test_sigterm_stops_every_process_of_the_job(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "elastic.cli.main", "run", "--model", "tiny", "--nodes", "3",
           "--fault-tolerance", "1", "--steps", "1000", "--run-dir", str(run_dir)]  # fmt: skip
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job = ""
    try:
        job_file = run_dir / "job.json"
        job = wait_for(lambda: job_file.exists() and json.loads(job_file.read_text())["job"], 60, "job.json")
        # Training has begun when a worker of every node is up: 3 agents + 3 workers carry the job id.
        wait_for(lambda: len(_job_processes(job)) >= 6, 60, "the job's agents and workers")
        launcher.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # a second SIGTERM (`timeout` and a scheduler both sending one) during the cleanup
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=30)
        assert launcher.returncode == 128 + signal.SIGTERM, out
        assert "terminated (SIGTERM)" in out
        left = _job_processes(job)
        assert not left, f"processes of job {job} outlived the launcher: {[p.pid for p in left]}"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for proc in _job_processes(job) if job else []:
            proc.kill()
