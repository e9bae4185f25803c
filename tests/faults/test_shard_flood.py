"""A flood of shard requests on a real run (issue 16): while a 4-node job trains and recovers
from a SIGKILL over gRPC, a separate process with the valid job token floods node 0's shard
server (tests/faults/flood_proc.py: concurrent streams of every shard it holds, a nonexistent
shard, requests naming too many shards). The job ends where the failure-free run ends (1e-5),
and the flooded worker's peak RSS stays within a generous bound of the same worker's in a calm
run of the same job, run in the same test."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from elastic.coordinator.etcd_server import EtcdServer
from elastic.records.config import ElasticConfig
from elastic.records.injection import parse_injection
from elastic.records.node_workers import read_registrations

from .runs import LiveJob, Result, check_same_training, reference_run, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

FLOODED_NODE = 0
RSS_ALLOWANCE = 256 << 20
"""How much more the flooded worker may peak at than in the calm run (generous: a few copies of
its shards and gRPC buffers are far below it; an unbounded flood is not)."""

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Result:
    return reference_run(tmp_path_factory, steps=20)


class PeakRss:
    """Samples the RSS of worker (node, 0) of `job` every 20 ms; `peak` is the largest seen."""

    def __init__(self, job: LiveJob, node: int) -> None:
        self.job, self.node = job, node
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pid = None
        while not self._stop.is_set():
            if pid is None:
                info = read_registrations(self.job.client, self.job.rk, node=self.node).get((self.node, 0))
                pid = info.pid if info is not None else None
            if pid is not None:
                try:
                    self.peak = max(self.peak, psutil.Process(pid).memory_info().rss)
                    self.samples += 1
                except psutil.NoSuchProcess:
                    return
            self._stop.wait(0.02)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(10)
        return self.peak


def config(run_dir: Path) -> ElasticConfig:
    """4 nodes, 2 pipelines, shards moved over gRPC; node 2 killed at step 12 (its stage is
    fetched from node 0, the flooded one). Leases of 6 s: the flooder's CPU load on a small
    machine must not make a node look lost."""
    base = tiny_config(run_dir, nodes=4, pipelines=2, steps=20, shard_transport="grpc", lease_ttl=6)
    return dataclasses.replace(base, injections=(parse_injection("kill:node=2,step=12"),))


def run(run_dir: Path, etcd: str, *, flood: bool) -> tuple[Result, int, dict[str, int]]:
    """One run: its result, the flooded node's worker's peak RSS and the flooder's outcomes."""
    job = LiveJob(config(run_dir), etcd=etcd, timeout_s=300).start()
    rss = PeakRss(job, FLOODED_NODE)
    stop_file = run_dir.parent / f"{run_dir.name}.stop"
    flooder = None
    try:
        if flood:
            env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            flooder = subprocess.Popen(
                [sys.executable, "-m", "tests.faults.flood_proc", etcd, job.job, job.token, str(FLOODED_NODE),
                 str(stop_file), "8"],
                cwd=REPO, env=env, stdout=subprocess.PIPE, text=True,
            )
        result = job.result()
        peak = rss.stop()
        outcomes: dict[str, int] = {}
        if flooder is not None:
            stop_file.touch()
            out, _ = flooder.communicate(timeout=60)
            assert flooder.returncode == 0, out
            outcomes = json.loads(out.strip().splitlines()[-1])
        return result, peak, outcomes
    finally:
        rss.stop()
        if flooder is not None and flooder.poll() is None:
            flooder.kill()
            flooder.wait(10)
        job.close()


def test_a_flood_of_shard_requests_keeps_memory_bounded_and_training_exact(
    reference: Result, tmp_path: Path, etcd_server: EtcdServer
) -> None:
    (calm, calm_peak, _) = run(tmp_path / "calm", etcd_server.endpoint, flood=False)
    (flooded, flooded_peak, outcomes) = run(tmp_path / "flooded", etcd_server.endpoint, flood=True)
    for summary, state in (calm, flooded):
        check_same_training(summary, state, reference)
        assert summary.recoveries[0]["lost_nodes"] == [2] and summary.recoveries[0]["bytes_moved"] > 0
    # The flood reached the server: whole shards streamed, and the bad requests refused.
    assert outcomes.get("held:OK", 0) > 0, outcomes
    assert outcomes.get("missing:NOT_FOUND", 0) > 0, outcomes
    assert outcomes.get("too-many:INVALID_ARGUMENT", 0) > 0, outcomes
    assert calm_peak > 0 and flooded_peak > 0
    assert flooded_peak <= calm_peak + RSS_ALLOWANCE, (
        f"flooded worker peaked at {flooded_peak >> 20} MiB, the calm one at {calm_peak >> 20} MiB"
    )
    print(f"peak RSS of node {FLOODED_NODE}'s worker: calm {calm_peak >> 20} MiB, flooded {flooded_peak >> 20} MiB; "
          f"flood outcomes {outcomes}")
