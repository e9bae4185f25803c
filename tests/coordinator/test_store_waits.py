"""A blocked store wait is woken by the puts of its own keys only (elastic/coordinator/store_waits.py):
counted on etcd's /metrics (`etcd_debugging_mvcc_events_total`, the events etcd sent), against a
watch of the whole store prefix opened beside it as the reference. Before, a process's waits
shared a watch of the prefix, and every put under it reached every process with a wait open:
O(ranks x processes) events for a rendezvous of one put a rank."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from elastic.coordinator import EtcdConfig, EtcdServer, EtcdStore, JobKeys, connect
from elastic.coordinator.watch import PrefixWatch
from tests.polling import wait_for

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
