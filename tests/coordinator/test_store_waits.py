"""A blocked store wait is woken by the puts of its own keys only (elastic/coordinator/store_waits.py):
counted on etcd's /metrics (`etcd_debugging_mvcc_events_total`, the events etcd sent), against a
watch of the whole store prefix opened beside it as the reference. Before, a process's waits
shared a watch of the prefix, and every put under it reached every process with a wait open:
O(ranks x processes) events for a rendezvous of one put a rank. A client with more waiting keys
than `KEY_WATCHES_MAX` shares one watch of the prefix for the rest, and every wait still ends."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from elastic.coordinator import EtcdConfig, EtcdServer, EtcdStore, JobKeys, connect
from elastic.coordinator.store_waits import KEY_WATCHES_MAX
from elastic.coordinator.store_waits import wait_for as wait_for_keys
from elastic.coordinator.watch import PrefixWatch
from tests.polling import wait_for

from .test_store_api import etcd_requests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

OTHERS = 50
"""Keys put under the prefix while the wait is blocked."""


def _metric(server: EtcdServer, name: str) -> int:
    with urllib.request.urlopen(f"http://{server.endpoint}/metrics", timeout=10.0) as resp:
        text = resp.read().decode()
    return sum(int(float(line.split()[1])) for line in text.splitlines() if line.startswith(name + " "))


@pytest.fixture
def own_etcd() -> Iterator[EtcdServer]:
    """An etcd of this test's own: the event count is exact only with no other test on it."""
    with EtcdServer() as server:
        yield server


def test_a_wait_receives_the_puts_of_its_keys_only(own_etcd: EtcdServer) -> None:
    waiting, writing, watching = (connect(EtcdConfig(endpoint=own_etcd.endpoint)) for _ in range(3))
    prefix = JobKeys("waits").store("gen-1")
    store = EtcdStore(waiting, prefix, timeout=timedelta(seconds=30))
    writer = EtcdStore(writing, prefix)
    seen: list[Any] = []
    reference = PrefixWatch(watching, prefix, seen.extend)
    got: dict[str, bytes] = {}
    blocked = [threading.Thread(target=lambda k=k: got.__setitem__(k, store.get(k))) for k in ("a", "z")]
    try:
        assert reference.wait_ready(10.0)
        for t in blocked:
            t.start()
        # The reference's watch, and one of each missing key (both waits read them missing first).
        wait_for(lambda: _metric(own_etcd, "etcd_debugging_mvcc_watcher_total") == 3, 10.0, "a watch a key")
        before = _metric(own_etcd, "etcd_debugging_mvcc_events_total")
        for i in range(OTHERS):  # "a0".."a9" sort inside a prefix watch of "a", not in [a, a\1)
            writer.set(f"a{i}", b"other")
        writer.set("a", b"A")
        writer.set("z", b"Z")
        for t in blocked:
            t.join(20.0)
        assert got == {"a": b"A", "z": b"Z"}
        wait_for(lambda: len(seen) == OTHERS + 2, 10.0, "the reference saw every put")
        sent = _metric(own_etcd, "etcd_debugging_mvcc_events_total") - before
        assert sent - len(seen) == 2  # one event each for the two waits, none of the 50 others
    finally:
        reference.cancel()
        store.release()
        for c in (waiting, writing, watching):
            c.close()


def test_a_wait_on_two_keys_ends_with_the_second_put_and_keeps_both(own_etcd: EtcdServer) -> None:
    """Two keys, two watches, one wait: it ends only once both were put, and the gets after it
    cost no read (each watch carried its key's value)."""
    waiting, writing = (connect(EtcdConfig(endpoint=own_etcd.endpoint)) for _ in range(2))
    prefix = JobKeys("waits").store("gen-2")
    store = EtcdStore(waiting, prefix, timeout=timedelta(seconds=30))
    writer = EtcdStore(writing, prefix)
    got: list[bytes] = []
    reads: list[int] = []

    def connect_both() -> None:
        store.wait(["p", "q"])
        before = etcd_requests(own_etcd.endpoint, "Range")
        got.extend([store.get("p"), store.get("q")])
        reads.append(etcd_requests(own_etcd.endpoint, "Range") - before)

    blocked = threading.Thread(target=connect_both)
    try:
        blocked.start()
        wait_for(lambda: _metric(own_etcd, "etcd_debugging_mvcc_watcher_total") == 2, 10.0, "a watch a key")
        writer.set("q", b"Q")
        blocked.join(0.5)
        assert blocked.is_alive()  # "p" is still missing
        writer.set("p", b"P")
        blocked.join(20.0)
        assert got == [b"P", b"Q"] and reads == [0]
    finally:
        store.release()
        for c in (waiting, writing):
            c.close()


def test_a_compacted_key_watch_wakes_its_waiter_to_read_again(own_etcd: EtcdServer) -> None:
    """A wait whose watch would start in compacted history is woken at once, unsatisfied (its
    store re-reads and watches again), not left blocked until its timeout."""
    client: Any = connect(EtcdConfig(endpoint=own_etcd.endpoint))  # `compact` is not in EtcdClient
    prefix = JobKeys("waits").store("gen-3")
    try:
        old = int(client.get_prefix_response("/", count_only=True).header.revision)
        for i in range(5):
            client.put(f"{prefix}other{i}", "x")
        now = int(client.get_prefix_response("/", count_only=True).header.revision)
        client.compact(now, physical=True)
        started = time.monotonic()
        key = f"{prefix}k".encode()
        woke = wait_for_keys(client, prefix, {key}, old, 20.0, logical=lambda k: k, recheck=lambda: {key})
        assert woke is None and time.monotonic() - started < 10.0
        store = EtcdStore(client, prefix, timeout=timedelta(seconds=20))  # and the store's wait goes on
        done = threading.Thread(target=lambda: store.wait(["k"]))
        done.start()
        EtcdStore(client, prefix).set("k", b"v")
        done.join(20.0)
        assert not done.is_alive()
        store.release()
    finally:
        client.close()


def test_a_client_with_many_waiting_keys_shares_a_watch_of_the_prefix_for_the_rest(own_etcd: EtcdServer) -> None:
    waiting, writing = (connect(EtcdConfig(endpoint=own_etcd.endpoint)) for _ in range(2))
    prefix = JobKeys("waits").store("gen-4")
    store = EtcdStore(waiting, prefix, timeout=timedelta(seconds=30))
    writer = EtcdStore(writing, prefix)
    keys = [f"rank/{i}" for i in range(KEY_WATCHES_MAX + 8)]
    got: dict[str, bytes] = {}
    blocked = [threading.Thread(target=lambda k=k: got.__setitem__(k, store.get(k))) for k in keys]
    try:
        for t in blocked:
            t.start()
        wait_for(lambda: _metric(own_etcd, "etcd_debugging_mvcc_watcher_total") == KEY_WATCHES_MAX + 1, 10.0,
                 "a watch for each of the first keys, one of the prefix for the others")
        time.sleep(0.3)
        assert _metric(own_etcd, "etcd_debugging_mvcc_watcher_total") == KEY_WATCHES_MAX + 1
        for k in keys:
            writer.set(k, k.encode())
        for t in blocked:
            t.join(20.0)
        assert got == {k: k.encode() for k in keys}
        wait_for(lambda: _metric(own_etcd, "etcd_debugging_mvcc_watcher_total") == 0, 10.0, "every watch closed")
    finally:
        store.release()
        for c in (waiting, writing):
            c.close()
