"""The cases of torch's own Store test base (test/distributed/test_store.py, `StoreTestBase`, as of
torch 2.13), restated here, run against four stores: c10d's in-memory `HashStore` and a
`PrefixStore` over it (the reference: each case must hold on torch's own stores, so a case that
is wrong fails there first), `EtcdStore` bare, and `EtcdStore` through c10d's C++ `PrefixStore`
(every call crosses torch's Python-store trampoline); and both again with the sets and reads
relayed by a node's `StoreRelay` (store_relay.py), which must change no answer.

One gap is torch's, not the store's: torch 2.13's trampoline forwards no queue call, so a C++
`PrefixStore` over any Python store answers `queue_push`, `queue_pop` and `queue_len` with
NotImplementedError (upstream's own helper skips those cases for such a store). Those cases are
strict xfails through the wrapper: they turn into failures the day torch forwards the calls.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from elastic.coordinator import EtcdStore, JobKeys
from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.store_relay import StoreRelay, StoreRelayClient

KINDS = ("hash", "prefix-hash", "etcd", "prefix-etcd", "relay-etcd", "prefix-relay-etcd")
QUEUE_GAP = pytest.mark.xfail(
    raises=NotImplementedError, strict=True,
    reason="torch 2.13's Python-store trampoline forwards no queue call to a Python store",
)


def _kinds(*, queues: bool = False) -> list[Any]:
    return [pytest.param(k, marks=QUEUE_GAP) if queues and k.startswith("prefix-") and k.endswith("etcd") else k for k in KINDS]


@pytest.fixture
def store_relay(client: EtcdClient) -> Iterator[StoreRelay]:
    relay = StoreRelay(client, name=f"test-store-relay-{uuid.uuid4().hex}")
    yield relay
    relay.close()


@pytest.fixture
def make_store(request: pytest.FixtureRequest, job: str) -> Callable[[], dist.Store]:
    """A fresh store of the test's kind (its own keys), timeout 300 s as upstream's."""
    kind = request.node.callspec.params["kind"]

    def make() -> dist.Store:
        if kind.endswith("etcd"):
            relay = StoreRelayClient(request.getfixturevalue("store_relay").name) if "relay" in kind else None
            base: dist.Store = EtcdStore(request.getfixturevalue("client"), JobKeys(job).store(kind), relay=relay)
        else:
            base = dist.HashStore()
        base.set_timeout(timedelta(seconds=300))
        return dist.PrefixStore("test_prefix", base) if kind.startswith("prefix") else base

    return make


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", _kinds())
def test_set_get_check(kind: str, make_store: Callable[[], dist.Store]) -> None:
    store = make_store()
    for key, delta in (("key", 1), ("key", 2), ("key", 3)):
        store.add(key, delta)
    store.set("key0", "value0")
    store.add("key3", 1)
    store.set("key1", "value1")
    store.add("key3", 2)
    store.set("key2", "value2")
    for delta in (3, 4, 5, 6):
        store.add("key3", delta)
    assert store.num_keys() == 5  # key, key0, key1, key2, key3
    assert [store.get(k) for k in ("key", "key0", "key1", "key2", "key3")] == [
        b"6", b"value0", b"value1", b"value2", b"21"]
    assert store.check(["key3"]) and not store.check(["Randomkey3"])
    store.set("-key3", "7")
    assert store.get("-key3") == b"7"
    store.delete_key("-key3")
    assert store.num_keys() == 5


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", _kinds())
def test_compare_set(kind: str, make_store: Callable[[], dist.Store]) -> None:
    store = make_store()
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"wrong_old_value"  # missing key
    store.set("cs_key0", "value0")
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"value0"
    assert store.get("cs_key0") == b"value0"
    assert store.compare_set("cs_key0", "value0", "new_value0") == b"new_value0"
    assert store.get("cs_key0") == b"new_value0"
    assert store.compare_set("cs_key1", "", "new_value1") == b"new_value1"  # empty: created
    assert store.get("cs_key1") == b"new_value1"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", _kinds())
def test_simple_wait(kind: str, make_store: Callable[[], dist.Store]) -> None:
    store = make_store()
    with pytest.raises(RuntimeError, match="[t -i]imeout"):
        store.wait(["bad_key"], timedelta(seconds=0.25))
    store.add("good_key", 1)
    store.wait(["good_key"])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", _kinds())
def test_append(kind: str, make_store: Callable[[], dist.Store]) -> None:
    store = make_store()
    assert store.has_extended_api()  # upstream returns early otherwise: every store here has it
    store.set("foo", "po")
    store.append("foo", "tato")
    store.append("bar", "po")  # a missing key starts empty
    store.append("bar", "tato")
    assert (store.get("foo"), store.get("bar")) == (b"potato", b"potato")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", _kinds())
def test_multi_set_and_get(kind: str, make_store: Callable[[], dist.Store]) -> None:
    store = make_store()
    assert store.has_extended_api()
    store.multi_set(["foo", "bar"], ["po", "tato"])
    assert (store.get("foo"), store.get("bar")) == (b"po", b"tato")
    store.set("baz", "x")
    assert store.multi_get(["foo", "bar", "baz"]) == [b"po", b"tato", b"x"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", _kinds())
def test_clone(kind: str, make_store: Callable[[], dist.Store]) -> None:
    store = make_store()
    twin = store.clone()  # type: ignore[attr-defined]  # missing from torch's stubs
    assert isinstance(twin, dist.Store)
    store.set("foo", "bar")
    assert twin.get("foo") == b"bar"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", _kinds(queues=True))
def test_queues(kind: str, make_store: Callable[[], dist.Store]) -> None:
    store = make_store()
    assert not store.check(["foo"]) and store.queue_len("foo") == 0
    store.queue_push("foo", "1")
    store.queue_push("foo", "2")
    assert store.check(["foo"]) and store.queue_len("foo") == 2
    store.wait(["foo"])
    assert [store.queue_pop("foo"), store.queue_pop("foo")] == [b"1", b"2"]
    assert not store.check(["foo"]) and store.queue_len("foo") == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", _kinds(queues=True))
def test_queues_nonblocking(kind: str, make_store: Callable[[], dist.Store]) -> None:
    store = make_store()
    with pytest.raises(dist.QueueEmptyError, match="empty"):
        store.queue_pop("foo", block=False)
    store.queue_push("foo", "a")
    assert store.queue_pop("foo", block=False) == b"a"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", _kinds(queues=True))
def test_queues_bidirectional(kind: str, make_store: Callable[[], dist.Store]) -> None:
    store = make_store()
    store.queue_len("probe")  # the wrapper's gap shows here, in the test's thread
    got: dict[str, bytes] = {}
    errors: list[BaseException] = []

    def side(name: str, first_push: bool) -> None:
        mine, theirs = ("a", "b") if name == "a" else ("b", "a")
        local = store.clone()  # type: ignore[attr-defined]
        try:
            if first_push:
                local.queue_push(mine, f"{mine}1")
                got[name] = local.queue_pop(theirs)
            else:
                got[name] = local.queue_pop(theirs)
                local.queue_push(mine, f"{mine}1")
        except BaseException as e:  # noqa: BLE001  (re-raised in the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=side, args=("a", True)), threading.Thread(target=side, args=("b", False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not errors, errors
    assert got == {"a": b"b1", "b": b"a1"}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", _kinds(queues=True))
def test_queues_timeout(kind: str, make_store: Callable[[], dist.Store]) -> None:
    store = make_store()
    store.queue_len("probe")
    store.set_timeout(timedelta(seconds=0.01))
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.queue_pop("non_existant")
