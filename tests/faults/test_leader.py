"""The leader against a real etcd: halts, sync reports and re-plans on losses, joins at a step
boundary, the last step's decision, checkpoint fallback. Nodes are real etcd members (leases);
the workers' side of the protocol (sync reports, ready keys, registrations) is written by the test."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.coordinator import (
    EtcdConfig,
    EtcdServer,
    JobKeys,
    LeaderElection,
    Membership,
    MembershipConfig,
    NodeIdentity,
    connect,
)
from elastic.coordinator.generations import Generations
from elastic.coordinator.keys import RunKeys
from elastic.engine.checkpoint.writers import CheckpointWriter
from elastic.planning.cluster import ClusterSpec
from elastic.records.config import ElasticConfig
from elastic.records.generation import GenerationRecord, HaltRecord, Vote
from elastic.records.job import JobSpec
from elastic.records.recovery_timings import ReconfigTimings, RecoveryTimings, fold_all
from elastic.records.stop import submit_stop
from elastic.records.sync import ABORT, COMMIT, SyncReport
from elastic.records.workers import WorkerInfo, node_id
from elastic.roles.leader import Leader, NotLeader, decide
from elastic.roles.leader_replan import surviving_holders_cover
from elastic.roles.recovery_summary import summary_key
from templates.plan import even_plan
from tests.polling import wait_for

pytestmark = pytest.mark.timeout(60)


class World:
    """A job in etcd with real member leases and a running Leader."""

    def __init__(self, client: Any, job: str, tmp: Path, nodes: int) -> None:
        self.client, self.keys, self.rk = client, JobKeys(job), RunKeys(JobKeys(job))
        plan = even_plan(num_layers=6, nodes=list(range(nodes)), num_pipelines=2, global_microbatches=4,
                         microbatch_size=2, fault_tolerance=1)
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
                       address="127.0.0.1:0", devices=1), config=MembershipConfig(ttl=2))
        m.join()
        self.members[node] = m

    def halt(self, g: int) -> HaltRecord | None:
        value, _ = self.client.get(self.rk.halt(g))
        return HaltRecord.from_json(value) if value is not None else None

    def sync(self, g: int, node: int, committed: int | None, *, pending: int | None = None,
             vote_of: int | None = None) -> None:
        """Node `node`'s (one worker) sync report of g; `vote_of`: the step its last vote was of."""
        vote = None if vote_of is None else Vote(step=vote_of, grad_norm=1.0 + vote_of, loss=2.0 + vote_of)
        report = SyncReport(committed=committed, pending=pending, last_vote=vote, node=node, local_rank=0)
        self.client.put(self.rk.sync_report(g, node, 0), report.to_json())

    def recovery(self, g: int, node: int, *, write: bool = True) -> RecoveryTimings:
        """Node `node`'s (one worker, rank = node) recovery record of g, written unless not `write`."""
        rec = RecoveryTimings(ranks=[node], seen_at=100.0 * g + node, started_at=100.0 * g + 10 + node,
                              first_commit_at=100.0 * g + 20 - node,
                              reconfig=ReconfigTimings(transfer_s=0.1 * node, rebuild_s=0.2, bytes_fetched=1000 + node))
        if write:
            self.client.put(self.rk.recovery(g, node), rec.to_json())
        return rec

    def recovery_keys(self, g: int) -> list[str]:
        prefix = self.rk.prefix("recoveries", g)
        return sorted(m.key.decode()[len(prefix):] for _, m in self.client.get_prefix(prefix))

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


def test_a_loss_halts_and_resumes_at_the_furthest_step_a_survivor_committed(world: World) -> None:
    world.members[1].report_failure(reason="test: node 1 lost")
    halt = wait_for(lambda: world.halt(1), 15.0, "the abort halt of generation 1")
    assert halt.abort and "1" in halt.reason
    # Node 0 saw the vote of step 4 complete and committed it; node 2's wait on that vote was
    # cut short (step 4 pending); node 3 committed step 4 as well.
    world.sync(1, 0, 5, vote_of=4)
    world.sync(1, 2, 4, pending=4, vote_of=3)
    time.sleep(0.5)
    assert world.record(2) is None, "the leader must wait for every live worker's sync report"
    world.sync(1, 3, 5, vote_of=4)
    new = wait_for(lambda: world.record(2), 15.0, "generation 2")
    assert new.lost == [1] and new.resume_step == 5 and new.restore_checkpoint is None
    assert new.completed_vote == Vote(step=4, grad_norm=5.0, loss=6.0), "node 2 completes step 4 with node 0's vote"
    assert sorted(new.plan.nodes) == [0, 2, 3] and surviving_holders_cover(new.plan, {0, 2, 3})
    assert len(new.plan.pipelines) >= 2 and new.incarnations == {0: 0, 2: 0, 3: 0}
    assert (
        new.detected_at is not None and new.published_at is not None and new.published_at >= new.detected_at
    )


def test_a_vote_no_survivor_saw_complete_is_dropped(world: World) -> None:
    world.members[3].report_failure(reason="test: node 3 lost")
    wait_for(lambda: world.halt(1), 15.0, "the abort halt of generation 1")
    world.sync(1, 0, 6, pending=6, vote_of=5)
    world.sync(1, 1, 6, vote_of=5)
    world.sync(1, 2, 6, pending=6, vote_of=5)
    new = wait_for(lambda: world.record(2), 15.0, "generation 2")
    assert new.resume_step == 6 and new.completed_vote is not None and new.completed_vote.step == 5
    # A worker that never joined generation 2 says nothing of its steps: 2 was halted before
    # anyone trained in it, so generation 3 resumes where 2 began, with 2's completed vote.
    for g in (1, 2):  # each node's recovery record of generations 1 and 2
        for node in range(4):
            world.recovery(g, node)
    world.members[2].report_failure(reason="test: node 2 lost")
    wait_for(lambda: world.halt(2), 15.0, "the abort halt of generation 2")
    world.sync(2, 0, None, pending=None, vote_of=5)
    world.sync(2, 1, None, pending=None, vote_of=5)
    third = wait_for(lambda: world.record(3), 15.0, "generation 3")
    assert third.resume_step == 6 and third.completed_vote == new.completed_vote
    # the leader forgets generation 1 right after publishing 3 (a write after the record's), folds
    # generation 2's recovery records into one, and sweeps 1's (written after 2's publication)
    wait_for(lambda: not list(world.client.get_prefix(world.rk.sync(1))), 10.0,
             "generation 1's reports to be deleted once generation 3 is published")
    wait_for(lambda: world.recovery_keys(1) == ["all"], 10.0, "generation 1's recovery records folded")
    summary = RecoveryTimings.from_json(world.client.get(summary_key(world.rk, 1))[0])
    folded = fold_all([world.recovery(1, node, write=False) for node in range(4)])
    assert folded is not None and dataclasses.replace(summary, last_revision=None) == \
        dataclasses.replace(folded, node_bytes={n: 1000 + n for n in range(4)})
    _, plan3 = world.client.get(world.keys.plan(3))
    assert summary.last_revision is not None and summary.last_revision < plan3.mod_revision, \
        "the summary keeps its last record's revision, written before generation 3"
    wait_for(lambda: world.recovery_keys(2) == ["all"], 10.0, "generation 2's recovery records folded")


@pytest.mark.slow
def test_a_join_is_taken_in_at_a_step_boundary(world: World) -> None:
    world.join(4, 0)
    time.sleep(0.5)
    assert world.halt(1) is None, "a node whose workers have not registered is not taken in"
    info = WorkerInfo(pid=1, transfer_address="127.0.0.1:1", incarnation=0)
    world.client.put(world.rk.worker(4, 0), info.to_json(), lease=world.members[4].lease_id)
    halt = wait_for(lambda: world.halt(1), 15.0, "the boundary halt of generation 1")
    assert not halt.abort, "a join must not throw away the in-flight step's work"
    for node in range(3):
        world.sync(1, node, 3, vote_of=2)
    time.sleep(0.5)
    assert world.record(2) is None
    world.sync(1, 3, 3, vote_of=2)  # every worker stopped after the step the halt was voted into
    new = wait_for(lambda: world.record(2), 15.0, "generation 2")
    assert new.joined == [4] and 4 in new.plan.nodes and new.resume_step == 3


def test_a_stop_request_halts_at_a_boundary_then_names_the_step_every_worker_committed(world: World) -> None:
    """`elastic run`'s first Ctrl-C, `elastic drain --all` (elastic/records/stop.py)."""
    submit_stop(world.client, world.keys, "sigint")
    halt = wait_for(lambda: world.halt(1), 15.0, "the boundary halt of generation 1")
    assert not halt.abort and halt.stop_step is None and "stop of the whole job" in halt.reason
    for node in range(3):
        world.sync(1, node, 7, vote_of=6)
    time.sleep(0.5)
    assert world.halt(1) == halt, "the stop step waits for every live worker's sync report"
    world.sync(1, 3, 7, vote_of=6)
    stopped = wait_for(lambda: (h := world.halt(1)) is not None and h.stop_step is not None and h, 15.0, "the stop")
    assert stopped.stop_step == 7 and not stopped.abort
    wait_for(world.leader.finished.is_set, 5.0, "the leader to finish")
    # The workers leave, and so do their agents: a leader elected now sees no loss to recover from.
    world.members[3].leave()
    world.leader = Leader(world.client, world.keys, world.config, world.election, who="node0").start()
    wait_for(world.leader.finished.is_set, 15.0, "the new leader to see the job stopped")
    assert world.halt(1) == stopped and world.record(2) is None


def test_a_stop_settles_a_cut_short_vote_in_a_generation_first(world: World) -> None:
    submit_stop(world.client, world.keys, "cli")
    wait_for(lambda: world.halt(1), 15.0, "the boundary halt of generation 1")
    for node in (0, 1, 3):
        world.sync(1, node, 7, vote_of=6)
    world.sync(1, 2, 6, pending=6, vote_of=5)  # a failure elsewhere cut its wait on the vote of step 6 short
    new = wait_for(lambda: world.record(2), 15.0, "generation 2")
    assert new.resume_step == 7 and new.completed_vote is not None and new.completed_vote.step == 6
    halt = wait_for(lambda: world.halt(2), 15.0, "the boundary halt of generation 2")
    assert not halt.abort and "stop of the whole job" in halt.reason
    for node in range(4):
        world.sync(2, node, 8, vote_of=7)
    wait_for(lambda: (h := world.halt(2)) is not None and h.stop_step == 8, 15.0, "the stop at step 8")


def test_the_last_step_commits_only_when_every_rank_is_ready(world: World) -> None:
    last = world.config.spec.steps - 1
    world.ready(1, last, range(3))
    time.sleep(0.5)
    assert world.decision(1, last) is None, "three of four ranks ready must not commit"
    world.ready(1, last, range(3, 4))
    assert wait_for(lambda: world.decision(1, last), 15.0, "the commit decision of the last step") == COMMIT
    wait_for(world.leader.finished.is_set, 5.0, "the leader to finish")


def test_a_loss_during_the_last_step_aborts_it(world: World) -> None:
    last = world.config.spec.steps - 1
    world.ready(1, last, range(2))
    world.members[3].report_failure(reason="test: node 3 lost")
    wait_for(lambda: world.halt(1), 15.0, "the abort halt of generation 1")
    # The leader writes the halt, then the decision, in one round: wait for the second write.
    assert wait_for(lambda: world.decision(1, last), 15.0, "the decision of the last step") == ABORT
    for node in range(3):
        world.sync(1, node, last, vote_of=last - 1)
    new = wait_for(lambda: world.record(2), 15.0, "generation 2")
    assert new.resume_step == last and new.lost == [3]


def test_losing_every_holder_of_a_layer_falls_back_to_the_checkpoint(world: World, tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path / "ckpt", num_layers=6, tp_degree=1)
    writer.save_async(5, {(layer, 0): {"step": torch.tensor(5)} for layer in range(6)})
    writer.flush()
    # Nodes 0 and 2 are the first stages of both pipelines: layers 0-2 lose every holder.
    world.members[2].report_failure(reason="test")
    world.members[0].report_failure(reason="test")
    for g in (1, 2):  # seen together or one by one
        wait_for(lambda g=g: world.halt(g) or world.record(3) or (g == 2 and world.record(2)), 15.0, f"halt {g}")
        if world.record(g + 1) is None:
            for node in (1, 3):
                world.sync(g, node, 7 if g == 1 else None, vote_of=6)

    # Seen together or one by one: generation 2 (node 3 to fetch layers 0-2 from node 0) never
    # came into effect, so what live workers report holding, not plan 2, shows that layers 0-2
    # are gone.
    def fallback() -> GenerationRecord | None:
        return next((r for g in (3, 2) if (r := world.record(g)) and sorted(r.plan.nodes) == [1, 3]), None)

    record = wait_for(fallback, 15.0, "the checkpoint-fallback generation")
    assert record.restore_checkpoint == 5 and record.resume_step == 5 and record.completed_vote is None
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


@pytest.mark.slow
def test_the_leader_outlives_an_etcd_outage_longer_than_its_retries(
    tmp_path: Path, job: str, caplog: pytest.LogCaptureFixture
) -> None:
    """etcd SIGSTOPped for longer than the leader client's retries (one CI run lost its quorum
    past them, and the leader's thread died of the error, leaving the job without a leader):
    the leader's rounds fail while etcd is out of reach, and go on once it answers again."""
    with EtcdServer(data_dir=tmp_path / "etcd") as server:
        client = connect(EtcdConfig(endpoint=server.endpoint))
        impatient = connect(EtcdConfig(endpoint=server.endpoint, timeout=0.3, retry_s=0.1))
        world = World(client, job, tmp_path, nodes=4)
        try:
            world.leader.stop()
            world.leader = Leader(impatient, world.keys, world.config, world.election, who="node0").start()
            wait_for(lambda: world.leader.rounds >= 2, 10.0, "the leader's first rounds")
            assert server.pid is not None
            os.kill(server.pid, signal.SIGSTOP)
            try:
                time.sleep(1.6)  # a leader round (one a second) meets it past its retries; within the 2 s leases
            finally:
                os.kill(server.pid, signal.SIGCONT)
            wait_for(lambda: "etcd did not answer" in caplog.text, 3.0, "a leader round that met the outage")
            rounds = world.leader.rounds
            wait_for(lambda: world.leader.rounds >= rounds + 2, 10.0, "leader rounds after the outage")
            # It still leads: a loss is halted.
            world.members[1].report_failure(reason="test: node 1 lost")
            halt = wait_for(lambda: world.halt(1), 15.0, "the abort halt of generation 1")
            assert halt.abort and "1" in halt.reason
        finally:
            world.close()
            impatient.close()
            client.close()
