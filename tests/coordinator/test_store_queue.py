"""EtcdStore's queue API (`queue_push`, `queue_pop`, `queue_len`) against c10d's own in-memory
HashStore as the reference, and under contention: every item popped exactly once, in the order
each pusher pushed it."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from elastic.coordinator import EtcdServer, EtcdStore, JobKeys

from .test_store_api import etcd_requests


def _script(store: dist.Store) -> list[Any]:
    """One sequence of queue calls; what each returned or the type of error it raised."""
    out: list[Any] = []

    def call(fn: Any, *args: Any) -> None:
        try:
            out.append(fn(*args))
        except dist.DistStoreError as e:
            out.append(type(e).__name__)

    store.set_timeout(timedelta(seconds=0.3))
    call(store.queue_len, "q")
    call(store.check, ["q"])
    call(store.queue_pop, "q", False)  # empty: QueueEmptyError at once
    call(store.queue_pop, "q")  # empty: the store's timeout
    for value in ("a", b"b", "c"):
        call(store.queue_push, "q", value)
    call(store.queue_push, "other", "x")
    call(store.queue_len, "q")
    call(store.check, ["q"])
    call(store.wait, ["q"])
    call(store.queue_pop, "q")
    call(store.queue_pop, "q", False)
    call(store.queue_len, "q")
    call(store.queue_push, "q", "d")
    call(store.queue_pop, "q")
    call(store.queue_pop, "q")
    call(store.queue_len, "q")
    call(store.check, ["q"])
    call(store.queue_pop, "other")
    call(store.queue_len, "other")
    return out


@pytest.mark.timeout(30)
def test_queue_calls_answer_as_c10ds_hash_store(client: Any, job: str) -> None:
    want = _script(dist.HashStore())
    assert "QueueEmptyError" in want and "DistStoreError" in want  # the script reaches both errors
    assert _script(EtcdStore(client, JobKeys(job).store("q"))) == want


@pytest.mark.timeout(30)
def test_a_blocking_pop_wakes_on_the_push(client: Any, job: str) -> None:
    popper = EtcdStore(client, JobKeys(job).store("q"), timeout=timedelta(seconds=20))
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.append(popper.queue_pop("q")))
    thread.start()
    time.sleep(0.3)  # the pop is waiting
    assert thread.is_alive() and not got
    EtcdStore(client, JobKeys(job).store("q")).queue_push("q", "late")
    thread.join(10)
    assert got == [b"late"]


@pytest.mark.timeout(60)
def test_contended_pops_take_each_item_once_in_push_order(
    etcd_server: EtcdServer, client: Any, job: str
) -> None:
    pushers, poppers, per_pusher = 2, 4, 24
    prefix = JobKeys(job).store("q")
    start = threading.Barrier(pushers + poppers)
    popped: dict[int, list[bytes]] = {i: [] for i in range(poppers)}

    def push(i: int) -> None:
        store = EtcdStore(client, prefix)
        start.wait()
        for n in range(per_pusher):
            store.queue_push("work", f"{i}:{n:03d}")

    def pop(i: int) -> None:
        store = EtcdStore(client, prefix, timeout=timedelta(seconds=20))
        start.wait()
        for _ in range(pushers * per_pusher // poppers):
            popped[i].append(store.queue_pop("work"))

    before = etcd_requests(etcd_server.endpoint, "Put")
    threads = [threading.Thread(target=push, args=(i,)) for i in range(pushers)]
    threads += [threading.Thread(target=pop, args=(i,)) for i in range(poppers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    every = sorted(v for mine in popped.values() for v in mine)
    assert every == sorted(f"{i}:{n:03d}".encode() for i in range(pushers) for n in range(per_pusher))
    for mine in popped.values():  # each popper took the oldest item each time: a pusher's items in order
        for i in range(pushers):
            own = [v for v in mine if v.startswith(f"{i}:".encode())]
            assert own == sorted(own)
    assert etcd_requests(etcd_server.endpoint, "Put") - before == pushers * per_pusher  # one put a push
    assert EtcdStore(client, prefix).queue_len("work") == 0
