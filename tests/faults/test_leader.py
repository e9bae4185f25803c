"""The leader against a real etcd: commit decisions, aborts and re-plans on losses, joins,
checkpoint fallback. Nodes are real etcd members (leases); the workers' side of the protocol
(ready keys, registrations) is written by the test."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.coordinator import (
    EtcdServer,
    JobKeys,
    LeaderElection,
    Membership,
    MembershipConfig,
    NodeIdentity,
)
from elastic.coordinator.generations import Generations
from elastic.runtime.checkpoint import CheckpointWriter
from elastic.runtime.job import JobSpec
from elastic.runtime.leader import Leader, NotLeader, decide, surviving_holders_cover
from elastic.runtime.planning import ClusterSpec
from elastic.runtime.protocol import (
    ABORT,
    COMMIT,
    ElasticConfig,
    GenerationRecord,
    RunKeys,
    WorkerInfo,
    node_id,
)
from templates.plan import even_plan
from tests.polling import wait_for

pytestmark = pytest.mark.timeout(60)


class World:
    """A job in etcd with real member leases and a running Leader."""

    def __init__(self, client: Any, job: str, tmp: Path, nodes: int) -> None:
        self.client, self.keys, self.rk = client, JobKeys(job), RunKeys(JobKeys(job))
        plan = even_plan(num_layers=6, nodes=list(range(nodes)), num_pipelines=2, global_microbatches=4,
                         microbatch_size=2, fault_tolerance=1)  # fmt: skip
        spec = JobSpec(model="tiny", plan=plan, steps=20, run_dir=str(tmp), device="cpu")
        cluster = ClusterSpec(model="tiny", nodes=nodes, fault_tolerance=1)
        self.config = ElasticConfig(spec=spec, cluster=cluster, checkpoint_dir=str(tmp / "ckpt"))
        client.put(self.rk.config, self.config.to_json())
        self.members: dict[int, Membership] = {}
        for n in range(nodes):
            self.join(n, 0)
        for st in (st for pipe in plan.pipelines for st in pipe.stages):
            held = [[layer, 0] for layer in range(*st.layers)]
            client.put(
                self.rk.worker_holdings(st.node, 0), json.dumps(held), lease=self.members[st.node].lease_id
            )
        first = GenerationRecord(plan=plan, resume_step=0, incarnations=dict.fromkeys(range(nodes), 0))
        Generations(client, self.keys).publish(first.to_json(), expected=0)
        self.election = LeaderElection(client, self.keys, "node0", ttl=2).start()
        assert self.election.wait_leader(10.0)
        self.leader = Leader(client, self.keys, self.config, self.election, who="node0").start()

    def join(self, node: int, incarnation: int) -> None:
        m = Membership(self.client, self.keys, NodeIdentity(node_id=node_id(node), incarnation=incarnation,
                       address="127.0.0.1:0", devices=1), config=MembershipConfig(ttl=2))  # fmt: skip
        m.join()
        self.members[node] = m

    def ready(self, g: int, step: int, ranks: range) -> None:
        for r in ranks:
            self.client.put(self.rk.ready(g, step, r), "t")

    def decision(self, g: int, step: int) -> str | None:
        value, _ = self.client.get(self.rk.decision(g, step))
        return value.decode() if value is not None else None

    def record(self, g: int) -> GenerationRecord | None:
        gen = Generations(self.client, self.keys).get(g)
        return GenerationRecord.from_json(gen.plan) if gen is not None else None

    def close(self) -> None:
        self.leader.stop()
        self.election.resign()
        for m in self.members.values():
            m.leave()




@pytest.fixture
def world(client: Any, job: str, tmp_path: Path, etcd_server: EtcdServer) -> Iterator[World]:
    w = World(client, job, tmp_path, nodes=4)
    try:
        yield w
    finally:
        w.close()


def test_commits_when_all_ready_aborts_and_replans_on_a_loss(world: World) -> None:
    world.ready(1, 0, range(3))
    time.sleep(0.5)
    assert world.decision(1, 0) is None, "three of four ranks ready must not commit"
    world.ready(1, 0, range(3, 4))
    assert wait_for(lambda: world.decision(1, 0), 15.0, "the commit decision of step 0") == COMMIT
    world.ready(1, 1, range(2))
    world.members[1].report_failure(reason="test: node 1 lost")
    new = wait_for(lambda: world.record(2), 15.0, "generation 2")
    assert world.decision(1, 1) == ABORT
    assert new.lost == [1] and new.resume_step == 1 and new.restore_checkpoint is None
    assert sorted(new.plan.nodes) == [0, 2, 3] and surviving_holders_cover(new.plan, {0, 2, 3})
    assert len(new.plan.pipelines) >= 2 and new.incarnations == {0: 0, 2: 0, 3: 0}
    assert (
        new.detected_at is not None and new.published_at is not None and new.published_at >= new.detected_at
    )


def test_a_join_is_taken_in_at_a_step_boundary(world: World) -> None:
    world.join(4, 0)
    time.sleep(0.5)
    assert world.record(2) is None, "a node whose workers have not registered is not taken in"
    info = WorkerInfo(pid=1, transfer_address="127.0.0.1:1", incarnation=0)
    world.client.put(world.rk.worker(4, 0), info.to_json(), lease=world.members[4].lease_id)
    time.sleep(1.0)
    assert world.record(2) is None, "a join must not throw away the in-flight step's work"
    assert world.decision(1, 0) is None
    world.ready(1, 0, range(4))  # the in-flight step completes: the step boundary
    new = wait_for(lambda: world.record(2), 15.0, "generation 2")
    assert new.joined == [4] and 4 in new.plan.nodes and new.resume_step == 1
    assert world.decision(1, 0) == COMMIT and world.decision(1, 1) == ABORT


def test_losing_every_holder_of_a_layer_falls_back_to_the_checkpoint(world: World, tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path / "ckpt", num_layers=6, tp_degree=1)
    writer.save_async(5, {(layer, 0): {"step": torch.tensor(5)} for layer in range(6)})
    writer.flush()
    for step in range(7):
        world.ready(1, step, range(4))
        assert wait_for(functools.partial(world.decision, 1, step), 15.0, f"the commit decision of step {step}") == COMMIT
    # Nodes 0 and 2 are the first stages of both pipelines: layers 0-2 lose every holder.
    world.members[2].report_failure(reason="test")
    world.members[0].report_failure(reason="test")

    # Seen together or one by one: generation 2 (node 3 to fetch layers 0-2 from node 0) never
    # came into effect, so what live workers report holding, not plan 2, shows that layers 0-2
    # are gone.
    def fallback() -> GenerationRecord | None:
        return next((r for g in (3, 2) if (r := world.record(g)) and sorted(r.plan.nodes) == [1, 3]), None)

    record = wait_for(fallback, 15.0, "the checkpoint-fallback generation")
    assert record.restore_checkpoint == 5 and record.resume_step == 5
    assert "CHECKPOINT FALLBACK" in record.reason and sorted(record.plan.nodes) == [1, 3]


def test_decisions_are_fenced_by_the_leader_key(client: Any, job: str) -> None:
    # A leader SIGSTOPped past its TTL and resumed must not abort a step of the generation its
    # successor runs: a fenced decision is written only while the writer holds the leader key.
    keys, rk = JobKeys(job), RunKeys(JobKeys(job))
    stale = client.transactions.value(keys.leader) == "node0"
    with pytest.raises(NotLeader):
        decide(client, rk, 2, 7, ABORT, fence=stale)
    assert client.get(rk.decision(2, 7))[0] is None
    client.put(keys.leader, "node1")
    current = client.transactions.value(keys.leader) == "node1"
    assert decide(client, rk, 2, 7, COMMIT, fence=current) == COMMIT
    assert decide(client, rk, 2, 7, ABORT, fence=stale) == COMMIT  # the decision that stands
