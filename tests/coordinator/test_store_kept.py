"""A `wait` keeps the values of its keys (read, or carried by the watch that woke it) for the same
thread's following `get`s (elastic/coordinator/store.py): gloo's connect (a wait for a peer's
address, then a get of it) costs etcd one read, as a get alone does (counted on etcd's /metrics,
against that reference), a counter's value is never taken from the watch (a fold puts a partial sum), and
a kept value is never returned once a request on the store, by any thread or clone, came between:
the get then reads what another client wrote meanwhile."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from elastic.coordinator import EtcdServer, EtcdStore, JobKeys

from .test_store_api import etcd_requests

pytestmark = pytest.mark.timeout(60)


def _stores(client: Any, job: str) -> tuple[EtcdStore, EtcdStore]:
    prefix = JobKeys(job).store("gen-1")
    return (EtcdStore(client, prefix, timeout=timedelta(seconds=5)),
            EtcdStore(client, prefix, timeout=timedelta(seconds=5)))


def _reads(etcd_server: EtcdServer, call: Any) -> tuple[Any, int]:
    before = etcd_requests(etcd_server.endpoint, "Range")
    out = call()
    return out, etcd_requests(etcd_server.endpoint, "Range") - before


def test_a_wait_then_a_get_cost_one_read_like_a_get_alone(etcd_server: EtcdServer, client: Any, job: str) -> None:
    writer, reader = _stores(client, job)
    writer.set("addr/0", b"10.0.0.1:1000")
    writer.set("addr/1", b"10.0.0.2:1000")
    wrapper = dist.PrefixStore("addr", reader)  # through torch's C++ trampoline, as gloo calls it

    value, alone = _reads(etcd_server, lambda: wrapper.get("0"))
    assert value == b"10.0.0.1:1000" and alone == 1

    def connect() -> bytes:
        wrapper.wait(["1"])
        return wrapper.get("1")

    value, paired = _reads(etcd_server, connect)
    assert value == b"10.0.0.2:1000" and paired == alone
    value, again = _reads(etcd_server, lambda: wrapper.get("1"))  # a kept value serves one get
    assert value == b"10.0.0.2:1000" and again == 1


def test_a_kept_value_is_dropped_by_any_request_in_between(client: Any, job: str) -> None:
    writer, reader = _stores(client, job)
    writer.set("k", b"1")

    reader.wait(["k"])
    writer.set("k", b"2")  # another client: the reader learns nothing of it ...
    assert reader.get("k") == b"1"  # ... so the value its wait kept is still a valid answer

    reader.wait(["k"])
    writer.set("k", b"3")
    assert not reader.check(["missing"])  # any request of the reader in between
    assert reader.get("k") == b"3"

    reader.wait(["k"])
    reader.set("k", b"4")  # its own write
    assert reader.get("k") == b"4"

    reader.wait(["k"])
    twin = reader.clone()
    other = threading.Thread(target=lambda: twin.set("k", b"5"))  # a clone, on another thread
    other.start()
    other.join()
    assert reader.get("k") == b"5"

    reader.add("n", 7)
    writer.add("n", 1)
    reader.wait(["n", "k"])  # a counter's kept value is its sum; one wait keeps both keys
    assert reader.get("n") == b"8" and reader.get("k") == b"5"


def test_a_wait_the_watch_woke_keeps_the_value_it_carried_but_not_a_counters(
    etcd_server: EtcdServer, client: Any, job: str
) -> None:
    writer, reader = _stores(client, job)

    def connect(key: str, write: Any) -> bytes:
        threading.Timer(0.3, write).start()  # after the reader's wait found the key missing
        reader.wait([key])
        return reader.get(key)

    value, reads = _reads(etcd_server, lambda: connect("late", lambda: writer.set("late", b"v")))
    assert value == b"v" and reads == 1, reads  # the wait's read; the get takes the watched value
    # A counter's put is a delta (a fold puts a partial sum): its value is read, and exact.
    value, reads = _reads(etcd_server, lambda: connect("n", lambda: writer.add("n", 5)))
    assert value == b"5" and reads == 2, reads
