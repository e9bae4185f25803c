"""Job access: a wrong token is refused with a clear error and the running job is not disturbed."""

from __future__ import annotations

import time
from typing import Any

import pytest

from elastic.coordinator import (
    EtcdConfig,
    EtcdServer,
    Generations,
    JobAccessError,
    JobKeys,
    LeaderElection,
    MemberEvent,
    Membership,
    MembershipConfig,
    NodeIdentity,
    admit,
    connect,
)
from elastic.coordinator.events import read_events

from .support import wait_for


def _node(name: str) -> NodeIdentity:
    return NodeIdentity(node_id=name, incarnation=0, address="127.0.0.1:0", devices=1)


class _Node:
    """A node joining a job the way the agent does (roles/agent.py): present the token, register
    (lease), campaign for leadership."""

    def __init__(self, etcd: EtcdConfig, job: str, name: str, token: str | None) -> None:
        self.keys = JobKeys(job)
        self.client = connect(etcd)
        self.token = token
        self.membership = Membership(self.client, self.keys, _node(name), config=MembershipConfig(ttl=2))
        self.election = LeaderElection(self.client, self.keys, name, ttl=2)
        self.generations = Generations(self.client, self.keys)

    def start(self, *, campaign: bool = True) -> _Node:
        admit(self.client, self.keys, self.token)
        self.membership.join()
        if campaign:
            self.election.start()
        return self

    def close(self) -> None:
        if self.election.started:
            self.election.resign()
        self.membership.leave()
        self.client.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_wrong_token_refused_job_undisturbed(etcd_server: EtcdServer, client: Any, job: str) -> None:
    etcd = EtcdConfig(endpoint=etcd_server.endpoint)
    a = _Node(etcd, job, "a", "s3cret").start()
    try:
        assert a.election.wait_leader(5.0)
        a.generations.publish('{"plan": 1}', expected=0, fence=a.election.leader_compare())
        seen: list[MemberEvent] = []
        watch = a.membership.watch(seen.append)
        assert watch.wait_ready(5.0)
        token_before = client.get(a.keys.token)[0]
        events_before = read_events(client, a.keys)

        for bad_token, message in (("wrong", "wrong job token"), (None, "requires a job token")):
            intruder = _Node(etcd, job, "b", bad_token)
            with pytest.raises(JobAccessError, match=message):
                intruder.start()
            intruder.client.close()

        time.sleep(0.5)  # give any stray write time to show up in the watch
        watch.cancel()
        assert seen == []
        assert set(a.membership.members()) == {"a"}
        assert a.election.leader() == "a" and a.election.is_leader()
        assert a.generations.current_number() == 1
        assert client.get(a.keys.token)[0] == token_before
        assert read_events(client, a.keys) == events_before

        # The right token is admitted, and the job sees the join.
        seen2: list[MemberEvent] = []
        watch2 = a.membership.watch(seen2.append)
        assert watch2.wait_ready(5.0)
        c = _Node(etcd, job, "c", "s3cret").start(campaign=False)
        wait_for(lambda: [e.identity.node_id for e in seen2 if e.kind == "join"] == ["c"], 5.0, "c to join")
        watch2.cancel()
        c.close()
    finally:
        a.close()


def _job_keys(client: Any, keys: JobKeys) -> dict[str, bytes]:
    return {meta.key.decode(): value for value, meta in client.get_prefix(keys.root)}


@pytest.mark.timeout(60)
def test_admit_refuses_wrong_and_missing_tokens_without_writing(client: Any, job: str) -> None:
    keys = JobKeys(job)
    admit(client, keys, "s3cret")  # the first node installs the token hash
    before = _job_keys(client, keys)
    assert list(before) == [keys.token] and b"s3cret" not in before[keys.token]
    for token, message in (("s3cret ", "wrong job token"), ("", "requires a job token"), (None, "requires a job token")):
        with pytest.raises(JobAccessError, match=message):
            admit(client, keys, token)
        assert _job_keys(client, keys) == before
    admit(client, keys, "s3cret")  # the right token still gets in
    assert _job_keys(client, keys) == before


@pytest.mark.timeout(60)
def test_a_job_without_token_refuses_a_node_with_one(client: Any, job: str) -> None:
    keys = JobKeys(job)
    admit(client, keys, None)
    with pytest.raises(JobAccessError, match="started without a job token"):
        admit(client, keys, "anything")
    admit(client, keys, None)


class _LateReader:
    """The real client, except that its first read of the token key finds nothing: as if another
    first node installed its record between this node's read and its create-only transaction."""

    def __init__(self, client: Any, key: str) -> None:
        self._client, self._key, self._missed = client, key, False

    def get(self, key: str) -> Any:
        if key == self._key and not self._missed:
            self._missed = True
            return None, None
        return self._client.get(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@pytest.mark.timeout(60)
def test_two_first_nodes_one_record_and_the_loser_is_checked_against_it(client: Any, job: str) -> None:
    keys = JobKeys(job)
    admit(client, keys, "s3cret")
    before = _job_keys(client, keys)
    with pytest.raises(JobAccessError, match="wrong job token"):  # lost the race with another token
        admit(_LateReader(client, keys.token), keys, "other")
    admit(_LateReader(client, keys.token), keys, "s3cret")  # lost the race with the same token
    assert _job_keys(client, keys) == before  # the winner's record, unchanged
