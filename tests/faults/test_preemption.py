"""Preemption = drain, on real processes (etcd, agents, workers) and a real SIGTERM.

SIGTERM to node 3's agent mid-run (4 nodes, 2 pipelines, f=1): the agent asks the leader for a
drain of its node; generation 2 names node 3 in `drained` and loses nothing, no failure is
reported, no step is discarded (every pipeline's step log holds each step once, in order, and
the drain replays nothing), node 3's workers report "drained", its agent exits 0, and the losses
and final state equal the failure-free run's (1e-5).

SIGTERM when the drain is impossible (2 one-node pipelines, f=1: the other node alone cannot
form 2 pipelines): the leader refuses, the node leaves as a failure (a failure report, exit 3),
and the survivor goes on as after any failure (the same final state).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.coordinator import EtcdServer
from elastic.coordinator.events import read_events
from elastic.records.generation import GenerationRecord
from elastic.records.injection_requests import InjectionRequest, InjectionStatus, read_requests, read_statuses
from elastic.records.summary import RunSummary

from .runs import (
    LiveJob,
    agent_pid,
    check_same_training,
    reference_run,
    signal_other_thread,
    step_logs,
    tiny_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 24
PREEMPT_AT = 4
"""SIGTERM once this many steps are committed."""


class Outcome:
    """What a run with one SIGTERMed agent left: summary, final state, etcd records, agent log."""

    def __init__(self, job: LiveJob, node: int) -> None:
        self.summary, self.state = job.result()
        client, keys = job.client, job.keys
        self.requests: list[InjectionRequest] = [r for r in read_requests(client, keys.root) if r.kind == "drain"]
        self.statuses: dict[str, InjectionStatus] = read_statuses(client, keys.root)
        self.events = read_events(client, keys)
        self.failed = [m.key.decode() for _, m in client.get_prefix(keys.failed, keys_only=True)]
        self.records = {
            int(m.key.decode().rsplit("/", 1)[1]): GenerationRecord.from_json(v)
            for v, m in client.get_prefix(keys.plans)
        }
        self.done = {m.key.decode(): v.decode() for v, m in client.get_prefix(job.rk.done)}
        self.agent_log = (Path(job.config.spec.run_dir) / "logs" / f"agent{node}.inc0.log").read_text()
        self.run_dir = Path(job.config.spec.run_dir)


def _sigterm_agent(job: LiveJob, node: int) -> None:
    """SIGTERM the agent of `node` (its worker's parent) once PREEMPT_AT steps are committed, to
    one of its helper threads: the kernel may deliver a process's signal to any thread, and the
    agent must act on it at once all the same (an agent whose main thread slept in an untimed
    wait did so only when the job ended)."""
    job.wait_committed(PREEMPT_AT)
    signal_other_thread(agent_pid(job.job, node), signal.SIGTERM)


def _preempted_run(run_dir: Path, etcd: str, *, nodes: int, pipelines: int, node: int) -> Outcome:
    config = tiny_config(run_dir, nodes=nodes, pipelines=pipelines, steps=STEPS)
    job = LiveJob(config, etcd=etcd, timeout_s=240.0).start()
    try:
        _sigterm_agent(job, node)
        return Outcome(job, node)
    finally:
        job.close()


@pytest.fixture(scope="module")
def drained(etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    yield _preempted_run(tmp_path_factory.mktemp("preempt-drain"), etcd_server.endpoint, nodes=4, pipelines=2, node=3)


@pytest.fixture(scope="module")
def refused(etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    yield _preempted_run(tmp_path_factory.mktemp("preempt-refused"), etcd_server.endpoint, nodes=2, pipelines=2,
                         node=1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunSummary, dict[str, torch.Tensor]]:
    return reference_run(tmp_path_factory, steps=STEPS)


def test_sigterm_drains_the_node_at_a_step_boundary(drained: Outcome, reference: Any) -> None:
    (req,) = drained.requests
    assert req.by == "sigterm" and req.node == 3 and req.incarnation == 0, req
    status = drained.statuses[req.id]
    assert status.state == "done" and status.generation == 2, status
    assert sorted(drained.records) == [1, 2], "one reconfiguration: the drain"
    record = drained.records[2]
    assert record.drained == [3] and record.lost == [] and 3 not in record.plan.nodes, record
    assert record.replay is None and record.restore_checkpoint is None, "a drain replays and restores nothing"
    assert len(record.plan.pipelines) >= 2, "the drained generation keeps f+1 pipelines"
    # No failure: no report, no failure event, the workers left "drained", the agent exited 0.
    assert drained.failed == [] and not [e for e in drained.events if e["kind"] == "failure"]
    assert [e["id"] for e in drained.events if e["kind"] == "preempted"] == [req.id]
    assert [v for k, v in drained.done.items() if k.endswith("/done/3/0")] == ["drained"], drained.done
    assert "exiting with code 0" in drained.agent_log, drained.agent_log[-2000:]
    # Nothing discarded: every pipeline's log commits each step once, in order.
    for name, results in step_logs(drained.run_dir).items():
        steps = [r.step for r in results]
        assert steps == sorted(set(steps)), f"{name}: a step logged twice or out of order: {steps}"
    recoveries = drained.summary.recoveries
    assert [r["drained_nodes"] for r in recoveries] == [[3]] and recoveries[0]["lost_nodes"] == [], recoveries
    assert not recoveries[0].get("replayed_fraction"), recoveries[0]
    check_same_training(drained.summary, drained.state, reference, steps=STEPS)


def test_sigterm_when_the_drain_is_impossible_leaves_as_a_failure(refused: Outcome, reference: Any) -> None:
    (req,) = refused.requests
    status = refused.statuses[req.id]
    assert status.state == "refused" and "cannot form the 2 pipelines" in status.detail, status
    assert [k for k in refused.failed if "/node1/" in k], refused.failed
    assert any("drain was refused" in str(e.get("reason")) for e in refused.events if e["kind"] == "failure")
    assert refused.records[2].lost == [1] and refused.records[2].drained == [], refused.records[2]
    assert "exiting with code 3" in refused.agent_log, refused.agent_log[-2000:]
    check_same_training(refused.summary, refused.state, reference, steps=STEPS)
