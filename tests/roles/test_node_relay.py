"""The agent's relay (elastic/roles/node_relay.py) on a real etcd: a node's workers' puts land as
one transaction (one revision) where direct puts take one each, with their values and leases; a
worker that is late delays a batch by the linger only, and one that is gone not at all; bad requests are refused without
losing the relay, and a worker whose relay is gone puts directly. Recovery records fold into their
node's one key, in the same transaction, across batches and beside a worker that writes its own,
each worker counted once; so do a node's sync reports and its workers' registrations, with or
without a relay. A put on a lease that an etcd stall took waits for the agent's new lease."""

from __future__ import annotations

import json
import socket
import threading
import uuid
from typing import Any

import pytest

from elastic.records.node_holdings import node_holdings_key
from elastic.records.node_sync import reports_of
from elastic.records.node_workers import node_workers_key, read_registrations, registration
from elastic.records.recovery_timings import ReconfigTimings, RecoveryTimings
from elastic.records.sync import SyncReport
from elastic.records.workers import WorkerInfo
from elastic.roles.holders import read_holdings
from elastic.roles.node_relay import NodeRelay, RelayClient, RelayError, put_all
from elastic.roles.worker_feeds import write_sync
from elastic.transfer.shards import ShardKey

pytestmark = pytest.mark.timeout(60)


def _revision(client: Any) -> int:
    return int(client.get_response("/no-such-key").header.revision)


def _name() -> str:
    return f"test-relay-{uuid.uuid4().hex[:10]}"


def _puts(job: str, worker: int) -> list[tuple[str, str, int | None]]:
    return [(f"/{job}/sync/{worker}", json.dumps({"worker": worker}), None), (f"/{job}/rec/{worker}", str(worker), None)]


def _send_all(name: str, job: str, workers: list[int]) -> None:
    """Each worker of `workers` puts its keys through the relay at once, from its own thread."""
    _send_from({w: RelayClient(name) for w in workers}, job, workers)


def _send_from(clients: dict[int, RelayClient], job: str, which: list[int]) -> None:
    """Workers `which` put their keys at once, each through its client of `clients` from its own
    thread; every one must be answered within 20 s."""
    errors: list[BaseException] = []
    done: list[int] = []

    def one(worker: int) -> None:
        try:
            clients[worker].put(_puts(job, worker))
            done.append(worker)
        except BaseException as exc:  # handed to the test
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(w,)) for w in which]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    assert sorted(done) == sorted(which), f"answered: {done} of {which}"


def test_a_node_writes_one_transaction(client: Any, job: str) -> None:
    direct = _revision(client)
    for key, value, lease in _puts(job, 99):  # the reference: each put a revision of its own
        client.put(key, value, lease=lease)
    assert _revision(client) - direct == 2
    relay = NodeRelay(client, name=_name(), workers=8, linger_s=10.0)  # only a full batch may flush early
    try:
        before = _revision(client)
        _send_all(relay.name, job, list(range(8)))
        assert _revision(client) - before == 1 and relay.transactions == 1
        for w in range(8):
            assert json.loads(client.get(f"/{job}/sync/{w}")[0]) == {"worker": w}
            assert client.get(f"/{job}/rec/{w}")[0] == str(w).encode()
    finally:
        relay.close()


def test_a_missing_worker_costs_the_linger_only(client: Any, job: str) -> None:
    relay = NodeRelay(client, name=_name(), workers=4, linger_s=0.2)
    try:
        before = _revision(client)
        _send_all(relay.name, job, [0, 1])  # two of four: written after the linger, together
        assert _revision(client) - before == 1 and relay.transactions == 1
        assert client.get(f"/{job}/sync/1")[0] is not None
    finally:
        relay.close()


def test_a_worker_that_is_gone_is_not_waited_for(client: Any, job: str) -> None:
    """Four workers connect; two exit (their connections close). The next batch of the other two is
    written without waiting out the linger (60 s here, beyond the test's timeout)."""
    relay = NodeRelay(client, name=_name(), workers=4, linger_s=60.0)
    workers = {w: RelayClient(relay.name) for w in range(4)}
    try:
        _send_from(workers, job, [0, 1, 2, 3])  # a full batch: no wait
        workers[2].close()
        workers[3].close()
        before = _revision(client)
        _send_from(workers, job, [0, 1])
        assert _revision(client) - before == 1 and relay.transactions == 2
    finally:
        for w in workers.values():
            w.close()
        relay.close()


def test_leases_go_through(client: Any, job: str) -> None:
    lease = client.lease(30)
    relay = NodeRelay(client, name=_name(), workers=1)
    try:
        RelayClient(relay.name).put([(f"/{job}/held", "x", lease.id)])
        assert client.get(f"/{job}/held")[0] == b"x"
        client.revoke_lease(lease.id)
        assert client.get(f"/{job}/held")[0] is None  # it went with the lease, as a direct put's would
    finally:
        relay.close()


def test_a_put_on_a_lease_lost_in_a_stall_waits_for_the_new_one(client: Any, job: str) -> None:
    """The node's lease expired while it lived (an etcd stall): a worker's put naming it waits
    until the agent registers again (`relet`) and lands on the new lease, with the keys written
    on the old one; with no relet it fails after RELET_WAIT_S (monkeypatched short)."""
    old, new = client.lease(30), client.lease(30)
    relay = NodeRelay(client, name=_name(), workers=1)
    try:
        RelayClient(relay.name).put([(f"/{job}/registered", "r", old.id)])
        client.revoke_lease(old.id)  # what the stall did
        threading.Timer(0.3, relay.relet, args=(old.id, new.id)).start()
        RelayClient(relay.name).put([(f"/{job}/held", "x", old.id)])  # answered once relet
        for key, value in ((f"/{job}/registered", b"r"), (f"/{job}/held", b"x")):
            got, meta = client.get(key)
            assert got == value and meta.lease_id == new.id, key
    finally:
        relay.close()


def test_a_put_on_a_lease_never_relet_fails(client: Any, job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import elastic.roles.node_relay as node_relay

    monkeypatch.setattr(node_relay, "RELET_WAIT_S", 0.3)
    gone = client.lease(30)
    client.revoke_lease(gone.id)
    relay = NodeRelay(client, name=_name(), workers=1)
    try:
        with pytest.raises(RelayError, match="lease not found"):
            RelayClient(relay.name).put([(f"/{job}/held", "x", gone.id)])
    finally:
        relay.close()


def test_bad_requests_are_refused_and_the_relay_goes_on(client: Any, job: str) -> None:
    relay = NodeRelay(client, name=_name(), workers=1)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.settimeout(10)
            raw.connect("\0" + relay.name)
            raw.sendall(b'{"puts": 3}\n')
            assert b"malformed request" in raw.recv(4096)
            raw.sendall(b"not json\n")
            assert b"malformed request" in raw.recv(4096)
            raw.sendall(b'{"puts": [], "folds": [["/k", "{\\"seen_at\\": 1.0}"]]}\n')  # not a RecoveryTimings
            assert b"malformed request" in raw.recv(4096) and client.get("/k")[0] is None
        put_all(client, RelayClient(relay.name), _puts(job, 1))
        assert client.get(f"/{job}/sync/1")[0] is not None and relay.transactions == 1
    finally:
        relay.close()


def test_a_worker_whose_relay_is_gone_puts_directly(client: Any, job: str) -> None:
    relay = NodeRelay(client, name=_name(), workers=1)
    worker = RelayClient(relay.name)
    put_all(client, worker, _puts(job, 1))
    relay.close()
    with pytest.raises(RelayError):
        RelayClient(relay.name).put(_puts(job, 2))
    put_all(client, worker, _puts(job, 3))  # its connection is gone too: the put goes direct
    assert client.get(f"/{job}/sync/3")[0] is not None and relay.transactions == 1


def _recovery(rank: int) -> RecoveryTimings:
    """Worker `rank`'s own record: every figure distinct."""
    return RecoveryTimings(ranks=[rank], seen_at=100.0 + rank, started_at=200.0 + 3 * rank % 7,
                           first_commit_at=300.0 + 5 * rank % 11,
                           reconfig=ReconfigTimings(transfer_s=0.1 * (7 * rank % 5), rebuild_s=0.01 * (3 * rank % 4),
                                                    bytes_fetched=1000 * rank + 1, bytes_collective=rank))


def _reference(records: list[RecoveryTimings]) -> RecoveryTimings:
    """What a node's record must say of `records`: the latest times, the largest phases, summed bytes."""
    return RecoveryTimings(
        ranks=sorted(r.ranks[0] for r in records), seen_at=max(r.seen_at for r in records),
        started_at=max(r.started_at for r in records), first_commit_at=max(r.first_commit_at for r in records),
        reconfig=ReconfigTimings(transfer_s=max(r.reconfig.transfer_s for r in records),
                                 rebuild_s=max(r.reconfig.rebuild_s for r in records),
                                 bytes_fetched=sum(r.reconfig.bytes_fetched for r in records),
                                 bytes_collective=sum(r.reconfig.bytes_collective for r in records)))


def _stored(client: Any, key: str) -> RecoveryTimings:
    return RecoveryTimings.from_json(client.get(key)[0])


def test_a_nodes_recovery_records_fold_into_one_key_in_its_one_transaction(client: Any, job: str) -> None:
    relay = NodeRelay(client, name=_name(), workers=4, linger_s=10.0)
    key = f"/{job}/recoveries/2/5"
    records = {w: _recovery(10 + w) for w in range(4)}
    workers = {w: RelayClient(relay.name) for w in range(4)}
    try:
        before = _revision(client)
        threads = [threading.Thread(target=workers[w].put, args=(_puts(job, w), [(key, records[w])])) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert _revision(client) - before == 1 and relay.transactions == 1
        assert _stored(client, key) == _reference(list(records.values()))
        assert all(client.get(f"/{job}/sync/{w}")[0] is not None for w in range(4))
    finally:
        for w in workers.values():
            w.close()
        relay.close()


def test_folds_across_batches_and_a_worker_writing_its_own_count_each_worker_once(client: Any, job: str) -> None:
    """Workers 0 and 1 come in one batch (after the linger); worker 2 writes directly (no relay);
    worker 3 comes through the relay, whose compare-and-swap then loses to worker 2's write and
    folds again; worker 3's record written again directly (an answer lost) changes nothing."""
    relay = NodeRelay(client, name=_name(), workers=4, linger_s=0.2)
    key = f"/{job}/recoveries/3/1"
    records = [_recovery(w) for w in range(4)]
    workers = {w: RelayClient(relay.name) for w in range(4)}
    try:
        _send_folds(workers, key, records, [0, 1])
        assert _stored(client, key) == _reference(records[:2])
        put_all(client, None, [], [(key, records[2])])
        assert _stored(client, key) == _reference(records[:3])
        _send_folds(workers, key, records, [3])
        assert _stored(client, key) == _reference(records)
        put_all(client, None, [], [(key, records[3])])
        assert _stored(client, key) == _reference(records)
        assert relay.transactions == 2
    finally:
        for w in workers.values():
            w.close()
        relay.close()


def _send_folds(clients: dict[int, RelayClient], key: str, records: list[RecoveryTimings], which: list[int]) -> None:
    threads = [threading.Thread(target=clients[w].put, args=([], [(key, records[w])])) for w in which]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)


def _halted(client: Any, rk: Any, relay: NodeRelay | None, node: int, workers: list[int], *,
            lease: int) -> list[SyncReport]:
    """Workers `workers` of `node` report their halt of generation 7 at once (`write_sync`), each from
    its own thread, through `relay` (None: each writes its own); their reports."""
    reports = [SyncReport(committed=30 + (lr == 2), pending=None, last_vote=None, node=node, local_rank=lr)
               for lr in workers]
    clients = [None if relay is None else RelayClient(relay.name) for _ in workers]
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            write_sync(client, rk, 7, reports[i], holdings=[(workers[i], workers[i])], lease=lease, relay=clients[i])
        except BaseException as exc:  # handed to the test
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for c in clients:
        if c is not None:
            c.close()
    assert not errors, errors
    return reports


def test_a_nodes_sync_reports_are_one_key_through_the_relay_or_not(client: Any, job: str) -> None:
    """Through the relay, a node's 4 reports and holdings are one transaction, its reports one key
    and its holdings one key on its lease; without one (torchrun's workers), 4 workers folding
    their own at once into the same keys (compare-and-swaps that lose and fold again) give the
    same keys, each worker once."""
    from elastic.coordinator.keys import JobKeys, RunKeys

    rk = RunKeys(JobKeys(job))
    relay = NodeRelay(client, name=_name(), workers=4, linger_s=10.0)
    lease = client.lease(60)
    try:
        before = _revision(client)
        sent = _halted(client, rk, relay, 3, [0, 1, 2, 3], lease=lease.id)
        assert _revision(client) - before == 1 and relay.transactions == 1
    finally:
        relay.close()
    assert [k.decode().rsplit("/", 1)[1] for k in _keys(client, rk.sync(7))] == ["all"]
    assert reports_of(client.get(rk.node_sync(7, 3))[0]) == sent
    assert [k.decode().rsplit("/", 1)[1] for k in _keys(client, rk.holdings)] == ["all"]
    assert read_holdings(client, rk) == {(3, lr): (ShardKey(lr, lr),) for lr in range(4)}
    _, meta = client.get(node_holdings_key(rk, 3))
    assert meta.lease_id == lease.id, "the node's holdings go with its lease"

    direct = _halted(client, rk, None, 4, [0, 1, 2, 3], lease=lease.id)
    assert reports_of(client.get(rk.node_sync(7, 4))[0]) == direct
    assert len(_keys(client, rk.sync(7))) == 2
    assert read_holdings(client, rk) == {(n, lr): (ShardKey(lr, lr),) for n in (3, 4) for lr in range(4)}
    lease.revoke()
    assert read_holdings(client, rk) == {}


def _keys(client: Any, prefix: str) -> list[bytes]:
    return [m.key for _, m in client.get_prefix(prefix, keys_only=True)]


def test_a_nodes_registrations_are_one_key_through_the_relay_or_not(client: Any, job: str) -> None:
    """Through the relay, a node's 4 workers register in one transaction, as one key on its lease;
    without one, 4 workers registering at once (compare-and-swaps) give the same key. A restarted
    node's first worker replaces its old incarnation's registrations."""
    from elastic.coordinator.keys import JobKeys, RunKeys

    rk = RunKeys(JobKeys(job))
    infos = {(n, lr): WorkerInfo(pid=1000 * n + lr, transfer_address=f"127.0.0.1:{2000 + lr}", incarnation=0)
             for n in (3, 4) for lr in range(4)}
    lease = client.lease(60)
    relay = NodeRelay(client, name=_name(), workers=4, linger_s=10.0)
    try:
        before = _revision(client)
        _register(client, rk, relay, {w: i for w, i in infos.items() if w[0] == 3}, lease.id)
        assert _revision(client) - before == 1 and relay.transactions == 1
    finally:
        relay.close()
    _register(client, rk, None, {w: i for w, i in infos.items() if w[0] == 4}, lease.id)
    assert [k.decode() for k in _keys(client, rk.workers)] == [node_workers_key(rk, n) for n in (3, 4)]
    assert read_registrations(client, rk) == infos
    assert client.get(node_workers_key(rk, 3))[1].lease_id == lease.id, "the registrations go with the node's lease"
    again = WorkerInfo(pid=9, transfer_address="127.0.0.1:9", incarnation=1)
    _register(client, rk, None, {(4, 2): again}, lease.id)
    assert read_registrations(client, rk, node=4) == {(4, 2): again}
    lease.revoke()
    assert read_registrations(client, rk) == {}


def _register(client: Any, rk: Any, relay: NodeRelay | None, infos: dict[tuple[int, int], WorkerInfo],
              lease: int) -> None:
    """Each of `infos` registers at once from its own thread, as ElasticWorker does (`put_all` of
    its `registration`), through `relay` (None: each writes its own)."""
    errors: list[BaseException] = []

    def one(node: int, local_rank: int, info: WorkerInfo) -> None:
        relay_client = None if relay is None else RelayClient(relay.name)
        try:
            put_all(client, relay_client, [], [registration(rk, node, local_rank, info, lease)])
        except BaseException as exc:  # handed to the test
            errors.append(exc)
        finally:
            if relay_client is not None:
                relay_client.close()

    threads = [threading.Thread(target=one, args=(*w, i)) for w, i in infos.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
