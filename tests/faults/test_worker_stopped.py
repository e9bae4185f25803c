"""A worker SIGSTOPped alone (its agent still runs and keeps the node's lease): the agent sees
the stopped state within its 0.1 s check (elastic/roles/agent.py, `_watch_stopped`), reports the
node failed at once and the job recovers without waiting for a lease to expire. Real etcd,
agents and workers; the signal is a real SIGSTOP."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from elastic.coordinator import EtcdServer
from elastic.coordinator.events import read_events
from elastic.records.node_workers import read_registrations

from .runs import LiveJob, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

STOPPED_NODE = 3
LEASE_TTL = 30
"""Far longer than the test: only the agent's check can find the stopped worker in time."""


def test_a_stopped_worker_is_reported_by_its_agent(etcd_server: EtcdServer, tmp_path: Path) -> None:
    config = tiny_config(tmp_path, nodes=4, pipelines=2, steps=30, lease_ttl=LEASE_TTL)
    job = LiveJob(config, etcd=etcd_server.endpoint, timeout_s=150.0).start()
    try:
        job.wait_committed(5)
        info = read_registrations(job.client, job.rk, node=STOPPED_NODE).get((STOPPED_NODE, 0))
        assert info is not None
        pid = info.pid
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        while job.generation() < 2:
            assert time.monotonic() - t0 < 20.0, "no new generation 20 s after the SIGSTOP"
            time.sleep(0.05)
        summary, _ = job.result()
        events = read_events(job.client, job.keys)
    finally:
        job.close()
    assert summary.steps_committed == 30
    (rec,) = summary.recoveries
    assert rec["lost_nodes"] == [STOPPED_NODE]
    assert any(f"worker pid {pid} is stopped (hung)" in str(e) for e in events), events
