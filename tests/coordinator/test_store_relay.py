"""A node's store relay (elastic/coordinator/store_relay.py) commits what its workers sent while a
transaction was in flight as one transaction: etcd is SIGSTOPped while the first of 8 ranks'
requests is in flight, the other 7 arrive meanwhile, and after SIGCONT etcd has served exactly 2
transactions (counted on its /metrics), where the same 8 ranks without a relay make 8 requests
(the reference). Every rank then reads what a direct store reads. The relay cuts a batch at a
second set of one key (etcd refuses duplicate keys in a transaction), answers a malformed line
with an error and goes on, and a store whose relay is gone makes its requests itself."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from elastic.coordinator import EtcdConfig, EtcdServer, EtcdStore, JobKeys, connect
from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.store_relay import StoreRelay, StoreRelayClient, StoreRelayError

from .test_store_api import etcd_requests

pytestmark = [pytest.mark.timeout(60)]

RANKS = 8
PREFIX = JobKeys("relay").store("gen-1")


@pytest.fixture
def own_etcd() -> Iterator[EtcdServer]:
    """An etcd of this test's own: it is stopped, and its request counts are exact."""
    with EtcdServer() as server:
        yield server


@pytest.fixture
def clients(own_etcd: EtcdServer) -> Iterator[list[EtcdClient]]:
    made = [connect(EtcdConfig(endpoint=own_etcd.endpoint)) for _ in range(RANKS + 1)]
    for c in made:
        c.get("/warm")  # connected before etcd is stopped, as a running node's are
    yield made
    for c in made:
        c.close()


def _name() -> str:
    return f"test-store-relay-{uuid.uuid4().hex}"


def _requests(server: EtcdServer) -> int:
    return sum(etcd_requests(server.endpoint, m) for m in ("Txn", "Range", "Put", "DeleteRange"))


def _held_then_released(server: EtcdServer, calls: list[Callable[[], Any]]) -> list[Any]:
    """Run `calls` in threads, while etcd is stopped: the first, then the others 0.3 s later
    in order (0.05 s apart), then continue etcd 1.5 s after the last (0.5 s was once too short on
    a loaded machine: a set reached the relay after the read its batch was cut with); their
    results in order."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        threads[0].start()
        time.sleep(0.3)
        for t in threads[1:]:
            t.start()
            time.sleep(0.05)
        time.sleep(1.5)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    for t in threads:
        t.join(timeout=30.0)
    return results


@pytest.mark.parametrize("relayed", [False, True])
def test_what_arrives_during_a_transaction_is_the_next_one(
        relayed: bool, own_etcd: EtcdServer, clients: list[EtcdClient]) -> None:
    relay = StoreRelay(clients[-1], name=_name()) if relayed else None
    try:
        stores = [EtcdStore(c, PREFIX, timeout=timedelta(seconds=30),
                            relay=StoreRelayClient(relay.name) if relay else None) for c in clients[:RANKS]]
        before = _requests(own_etcd)
        _held_then_released(own_etcd, [lambda s=s, r=r: s.set(f"addr/{r}", f"host-{r}")  # type: ignore[misc]
                                        for r, s in enumerate(stores)])
        sets = _requests(own_etcd) - before
        # gloo's lazy ring: every rank reads its next peer's address (a wait, then the get it kept)
        before = _requests(own_etcd)
        got = _held_then_released(own_etcd, [lambda s=s, r=r: s.get(f"addr/{(r + 1) % RANKS}")  # type: ignore[misc]
                                             for r, s in enumerate(stores)])
        reads = _requests(own_etcd) - before
    finally:
        if relay is not None:
            relay.close()
    assert got == [f"host-{(r + 1) % RANKS}".encode() for r in range(RANKS)]
    direct = EtcdStore(clients[-1], PREFIX)
    assert [direct.get(f"addr/{r}") for r in range(RANKS)] == [f"host-{r}".encode() for r in range(RANKS)]
    if relayed:
        assert (sets, reads) == (2, 2)
        assert relay is not None and relay.requests == 4
    else:
        assert (sets, reads) == (RANKS, RANKS)


def test_a_second_set_of_a_key_and_a_bad_line(own_etcd: EtcdServer, clients: list[EtcdClient]) -> None:
    relay = StoreRelay(clients[-1], name=_name())
    try:
        first, second = (StoreRelayClient(relay.name) for _ in range(2))
        key = PREFIX + "k"
        before = _requests(own_etcd)
        revisions = _held_then_released(own_etcd, [lambda: first.set(PREFIX + "x", b"0"),
                                                   lambda: first.set(key, b"1"), lambda: second.set(key, b"2")])
        assert _requests(own_etcd) - before == 3  # the x put alone, then k twice: cut in two
        assert relay.requests == 3
        last = max(revisions[1:])
        assert EtcdStore(clients[0], PREFIX).get("k") == (b"1" if revisions[1] == last else b"2")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect("\0" + relay.name)
            raw.sendall(b'{"set": "nope"}\n{"read": []}\n')
            answers = b""
            while answers.count(b"\n") < 2:
                answers += raw.recv(4096)
        assert answers.count(b"malformed request") == 2
        assert first.read([key])[1][0].kvs[0].value in (b"1", b"2")  # it still serves
    finally:
        relay.close()


def test_a_read_sees_the_sets_of_its_batch(own_etcd: EtcdServer, clients: list[EtcdClient]) -> None:
    # The read of k reaches the relay before the set of k, and both are in one batch: the read
    # must see the set (it reports the revision it read at: a wait that found k missing there
    # would watch past the set and never wake).
    relay = StoreRelay(clients[-1], name=_name())
    try:
        reader, writer, first = (EtcdStore(c, PREFIX, timeout=timedelta(seconds=5), relay=StoreRelayClient(relay.name))
                                 for c in clients[:3])
        got = _held_then_released(own_etcd, [lambda: first.set("x", "0"), lambda: reader.get("k"),
                                             lambda: writer.set("k", "v")])
        assert got[1] == b"v"
        assert relay.requests == 3  # x alone; then the batch's set, then its read
    finally:
        relay.close()


def test_a_store_whose_relay_is_gone_goes_direct(own_etcd: EtcdServer, clients: list[EtcdClient]) -> None:
    relay = StoreRelay(clients[-1], name=_name())
    store = EtcdStore(clients[0], PREFIX, timeout=timedelta(seconds=10), relay=StoreRelayClient(relay.name))
    store.set("a", "1")
    assert relay.requests == 1
    relay.close()
    with pytest.raises(StoreRelayError):
        StoreRelayClient(relay.name).read([PREFIX + "a"])
    store.set("b", "2")  # the relay is gone: this one is direct
    assert store.get("a") == b"1" and store.get("b") == b"2"
    assert relay.requests == 1
    again = StoreRelay(clients[-1], name=relay.name)  # the agent's relay back under its name
    try:
        store.set("c", "3")
        assert again.requests == 1 and store.get("c") == b"3"
    finally:
        again.close()
