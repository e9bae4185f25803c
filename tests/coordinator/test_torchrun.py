"""torchrun with the elastic-etcd rendezvous: two local nodes form one job; killing one leaves the other running."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from elastic.coordinator import EtcdServer, JobKeys
from elastic.coordinator.membership import read_members

from .support import REPO, wait_for

TTL = 2
WORKER = str(Path(__file__).parent / "rdzv_worker.py")
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def _torchrun(endpoint: str, job: str, node: str, out: Path, extra_conf: str = "") -> subprocess.Popen[bytes]:
    conf = f"node_id={node},ttl={TTL},last_call_timeout=5{extra_conf}"
    args = [
        TORCHRUN, "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=elastic-etcd",
        f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}", f"--rdzv-conf={conf}",
        "--max-restarts=0", "--monitor-interval=0.5", WORKER, str(out), "90",
    ]
    log = open(out / f"{node}.log", "wb")  # noqa: SIM115 (the child owns it)
    return subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _record(out: Path, node: str) -> dict[str, Any] | None:
    path = out / f"{node}-0.json"
    return json.loads(path.read_text()) if path.exists() else None


def _stop(proc: subprocess.Popen[bytes], out: Path, node: str) -> None:
    rec = _record(out, node)
    if rec is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rec["pid"], signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_torchrun_nodes_one_job_kill_one(
    etcd_server: EtcdServer, client: Any, job: str, tmp_path: Path
) -> None:
    a = _torchrun(etcd_server.endpoint, job, "a", tmp_path)
    b = _torchrun(etcd_server.endpoint, job, "b", tmp_path)
    try:
        recs = wait_for(lambda: (_record(tmp_path, "a"), _record(tmp_path, "b"))
                        if _record(tmp_path, "a") and _record(tmp_path, "b") else None,
                        90.0, "workers of both nodes")
        ra, rb = recs
        assert ra["ELASTIC_JOB"] == rb["ELASTIC_JOB"] == job
        assert set(read_members(client, JobKeys(job))[0]) == {"a", "b"}
        assert ra["ELASTIC_RDZV_ROUND"] == rb["ELASTIC_RDZV_ROUND"] == "1"
        assert {ra["RANK"], rb["RANK"]} == {"0", "1"} and ra["WORLD_SIZE"] == rb["WORLD_SIZE"] == "2"

        # Kill node b entirely: its worker and its torchrun agent.
        os.kill(rb["pid"], signal.SIGKILL)
        os.killpg(b.pid, signal.SIGKILL)
        b.wait()
        wait_for(
            lambda: set(read_members(client, JobKeys(job))[0]) == {"a"}, TTL + 5.0, "b's lease to expire"
        )
        time.sleep(3.0)  # several torchrun monitor intervals
        assert a.poll() is None, "node a's torchrun exited"
        assert psutil.pid_exists(ra["pid"]) and psutil.Process(ra["pid"]).status() != "zombie"
        assert psutil.Process(ra["pid"]).ppid() == a.pid  # the same worker, never restarted
        assert _record(tmp_path, "a") == ra  # no new worker wrote a record
    finally:
        _stop(a, tmp_path, "a")
        _stop(b, tmp_path, "b")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_torchrun_node_with_wrong_token_is_refused(etcd_server: EtcdServer, client: Any, job: str,
                                                   tmp_path: Path) -> None:
    a = _torchrun(etcd_server.endpoint, job, "a", tmp_path, ",token=right")
    b = None
    try:
        ra = wait_for(lambda: _record(tmp_path, "a"), 90.0, "node a's worker")
        b = _torchrun(etcd_server.endpoint, job, "b", tmp_path, ",token=wrong")
        assert b.wait(timeout=60) != 0
        assert "wrong job token" in (tmp_path / "b.log").read_text()
        assert set(read_members(client, JobKeys(job))[0]) == {"a"}
        assert a.poll() is None and _record(tmp_path, "a") == ra and psutil.pid_exists(ra["pid"])
    finally:
        _stop(a, tmp_path, "a")
        if b is not None:
            _stop(b, tmp_path, "b")
