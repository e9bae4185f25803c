"""The leader's second witness (elastic/roles/leader_suspects.py) on a real etcd, with the probe's
answers given: a node whose member key went without a failure report is a suspect; one that
answers keeps its place, one that does not is recorded failed (and so refused if it registers
again); a reported failure is lost without a probe; every node suspect at once that all answer is
a control-plane stall that changes nothing; a leader that lost office records no failure."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from elastic.coordinator.keys import JobKeys
from elastic.coordinator.membership import Membership, MembershipConfig, NodeIdentity
from elastic.coordinator.probe import ProbeAnswer
from elastic.records.generation import GenerationRecord
from elastic.records.suspicion import KEPT, LOST, STALL, read_suspicion
from elastic.records.workers import node_id
from elastic.roles.leader_suspects import NoLongerLeader, SuspectGuard
from templates.plan import even_plan
from tests.polling import wait_for

pytestmark = pytest.mark.timeout(60)

NODES = [0, 1, 2, 3]
RECORD = GenerationRecord(plan=even_plan(num_layers=6, nodes=NODES, num_pipelines=2, global_microbatches=4,
                                         microbatch_size=2, fault_tolerance=1),
                          resume_step=0, incarnations=dict.fromkeys(NODES, 0))


def _address(node: int) -> str:
    return f"127.0.0.1:{7000 + node}"


class Answers:
    """The probe, given: the nodes whose agent answers alive; every address asked."""

    def __init__(self, alive: set[int]) -> None:
        self.alive = alive
        self.asked: list[str] = []

    def __call__(self, address: str, deadline_s: float) -> ProbeAnswer | None:
        self.asked.append(address)
        node = int(address.rsplit(":", 1)[1]) - 7000
        return ProbeAnswer(node_id=node_id(node), incarnation=0, alive=True) if node in self.alive else None


@pytest.fixture
def members(client: Any, job: str) -> Iterator[dict[int, Membership]]:
    """Nodes 0-3 of `job`, members (incarnation 0) on leases of their own; they leave afterwards."""
    joined = {}
    try:
        for n in NODES:
            m = Membership(client, JobKeys(job), NodeIdentity(node_id=node_id(n), incarnation=0, address=_address(n),
                                                              devices=1), config=MembershipConfig(ttl=30))
            m.join()
            joined[n] = m
        yield joined
    finally:
        for m in joined.values():
            with contextlib.suppress(Exception):  # a lease revoked by the test is gone already
                m.leave()


def _guard(client: Any, keys: JobKeys, answers: Answers, **kwargs: Any) -> SuspectGuard:
    guard = SuspectGuard(client, keys, who="node0", fault_tolerance=1, ttl=30, prober=answers, **kwargs)
    assert guard.members(RECORD) == dict.fromkeys(NODES, 0)  # every member seen (and its probe address)
    return guard


def _expire(client: Any, members: dict[int, Membership], nodes: list[int]) -> None:
    for n in nodes:  # what an expiry does to the key; the agent's lease keeper stops too
        lease = members[n].lease
        assert lease is not None
        lease.stop_refreshing()
        client.revoke_lease(lease.id)


def test_one_suspect_that_answers_is_kept_and_one_that_does_not_is_lost(
    client: Any, job: str, members: dict[int, Membership]
) -> None:
    keys = JobKeys(job)
    answers = Answers({0, 1, 3})
    guard = _guard(client, keys, answers)
    _expire(client, members, [3])
    assert guard.members(RECORD) == dict.fromkeys(NODES, 0)
    assert answers.asked == [_address(3)] and guard.cleared == 1
    record = read_suspicion(client, keys)
    assert record is not None and (record.suspects, record.answered, record.decision) == ([3], [3], KEPT)
    _expire(client, members, [2])
    assert guard.members(RECORD) == {0: 0, 1: 0, 3: 0}
    assert client.get(keys.failure(node_id(2), 0))[0] is not None, "the silent node is recorded failed"
    record = read_suspicion(client, keys)
    assert record is not None and record.silent == [2] and record.decision == LOST, record
    assert members[2].rejoin() is None, "a node recorded failed may not register again"
    assert members[3].rejoin() is not None, "one vouched for by its probe may"


def test_a_reported_failure_needs_no_probe(
    client: Any, job: str, members: dict[int, Membership]
) -> None:
    keys = JobKeys(job)
    answers = Answers(set(NODES))
    guard = _guard(client, keys, answers)
    client.put(keys.failure(node_id(1), 0), '{"reporter": "node1", "reason": "worker exited"}')
    _expire(client, members, [1])
    assert guard.members(RECORD) == {0: 0, 2: 0, 3: 0} and answers.asked == []


def test_every_node_suspect_and_answering_is_a_control_plane_stall(
    client: Any, job: str, members: dict[int, Membership]
) -> None:
    keys = JobKeys(job)
    guard = _guard(client, keys, Answers(set(NODES)))
    _expire(client, members, NODES)
    assert guard.members(RECORD) == dict.fromkeys(NODES, 0)
    record = read_suspicion(client, keys)
    assert record is not None and record.mass and record.decision == STALL and record.cleared_total == 4, record
    assert not list(client.get_prefix(keys.failed))


def test_a_leader_out_of_office_records_no_failure(
    client: Any, job: str, members: dict[int, Membership]
) -> None:
    keys = JobKeys(job)
    client.put(keys.leader, "node1")
    fence = client.transactions.value(keys.leader) == "node0"
    guard = _guard(client, keys, Answers({0, 1, 2}), fence=lambda: fence)
    _expire(client, members, [3])
    with pytest.raises(NoLongerLeader):
        guard.members(RECORD)
    assert client.get(keys.failure(node_id(3), 0))[0] is None


def test_a_suspect_that_answers_but_never_registers_again_is_lost_after_the_grace(
    client: Any, job: str, members: dict[int, Membership]
) -> None:
    """A one-way partition: the node answers its probe but cannot reach etcd. It keeps its place
    for `rejoin_s`, then is recorded failed; one that registers again within it stays."""
    keys = JobKeys(job)
    guard = _guard(client, keys, Answers(set(NODES)), rejoin_s=0.3)
    _expire(client, members, [2, 3])
    assert guard.members(RECORD) == dict.fromkeys(NODES, 0)
    assert members[3].rejoin() is not None  # node 3 registers again at once; node 2 never does
    wait_for(lambda: guard.members(RECORD) == {0: 0, 1: 0, 3: 0}, 5.0, "node 2 lost after the grace")
    failure, _ = client.get(keys.failure(node_id(2), 0))
    assert failure is not None and b"cut off from etcd" in failure
    assert client.get(keys.failure(node_id(3), 0))[0] is None
    record = read_suspicion(client, keys)
    assert record is not None and record.silent == [2] and record.decision == LOST, record


class ReportsWhileProbed(Answers):
    """The probe of a node whose monitor is reporting its crash: `Membership.report_failure`
    revoked the lease, the round saw a suspect, and the report's `failed/` key lands while the
    agent is asked; the agent (its worker's exit not yet seen) answers alive, or not at all."""

    def __init__(self, client: Any, keys: JobKeys, node: int, *, answers: bool) -> None:
        super().__init__(set(NODES) if answers else set(NODES) - {node})
        self.client, self.keys, self.node = client, keys, node

    def __call__(self, address: str, deadline_s: float) -> ProbeAnswer | None:
        if address == _address(self.node):
            self.client.put(self.keys.failure(node_id(self.node), 0), REPORT)
        return super().__call__(address, deadline_s)


REPORT = '{"reporter": "node1", "reason": "worker pid 1234 exited with code -9"}'


@pytest.mark.parametrize("answers", [True, False], ids=["answers-alive", "silent"])
def test_a_failure_reported_during_the_probe_is_lost_as_reported(
    client: Any, job: str, members: dict[int, Membership], answers: bool
) -> None:
    """The monitor's fast path races the guard: lease revoked first, report written after. The
    node is lost at once as its own report says: not kept on a stale answer (nor counted as
    cleared by the probe), and its report is not overwritten by the probe's verdict."""
    keys = JobKeys(job)
    probe = ReportsWhileProbed(client, keys, 1, answers=answers)
    guard = _guard(client, keys, probe)
    _expire(client, members, [1])  # report_failure's revoke; its put comes while the probe runs
    assert guard.members(RECORD) == {0: 0, 2: 0, 3: 0}
    assert probe.asked == [_address(1)] and guard.cleared == 0
    assert client.get(keys.failure(node_id(1), 0))[0] == REPORT.encode()
    assert read_suspicion(client, keys) is None  # no verdict of the probe's: the node reported itself
    assert guard.members(RECORD) == {0: 0, 2: 0, 3: 0} and probe.asked == [_address(1)]  # and stays lost
