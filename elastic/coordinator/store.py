"""An etcd-backed `torch.distributed.Store`, one key prefix per generation.

    store = EtcdStore(client, keys.store(f"gen-{g}"), timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)

No worker hosts the rendezvous (unlike TCPStore, whose host takes the store down with it), and a
new generation gets a fresh prefix, so stale keys of a broken group can never confuse the next.

Every call is one etcd request whatever the contention (no compare-and-swap retry loop):

- a store key `k` is the etcd key `<prefix>k` (its value, when set) plus, for `add`, one delta
  key `<prefix>k\\0<unique id>` per call. `add` writes its delta and reads `[k, k\\1)` in one
  transaction, which etcd serialises, so the sum it returns is exact and unique to the call
  (TCPStore's contract), and N contending adds cost N transactions. The adder that sees the
  `FOLD_EVERY`-th delta folds the deltas it saw into the value (one more transaction, guarded,
  skipped if anything changed), so a counter's read stays O(FOLD_EVERY) however often it grows.
- `get`, `check` and `wait` read `[k, k\\1)`; `set` and `delete_key` write the value and drop the
  deltas in one transaction. `append` is the exception: a read and a write guarded on it,
  repeated while other writers of the same key get there first.
- a `wait` keeps the values it read of its keys, or that the watch that woke it carried, and the
  same thread's following `get`s of those keys return them without a request, as long as no
  request was made on the store (or a clone) in between, by any thread: gloo connects to a peer
  with a `wait` for its address and then a `get` of it, so one costs one request, not two. A
  value kept this way is never older than anything the thread learnt from the store since.
- blocking calls (`get` of a missing key, `wait`) watch etcd from the revision at which the keys
  were seen missing (a watch per missing key, shared by a process's waits on it, or of the whole
  prefix once the client has many waits open, on the client's Watch stream, `store_waits.py`), so
  they wake on the write itself rather than on a polling tick, and raise
  `torch.distributed.DistStoreError` ("... timeout ...", the word torch's callers match on) when
  the timeout passes.

- with a `relay` (a worker under an agent that runs one: `ELASTIC_STORE_RELAY=1`), `set` and the reads of
  `get`, `check` and `wait` go to the node's store relay, which sends what the node's workers
  sent together in shared requests (`store_relay.py`): when a node's ranks call together, the
  requests are a node's, not a rank's. Anything else, and a request the relay fails, is direct.

A gloo group costs O(1) requests per rank and connected peer (measured on torch 2.13, see
`bench/rendezvous_scale.py`): one `set` of its address, then a `wait` (+ a `get` it answers) for
each peer it connects to, i.e. every rank of the group for an eager full mesh, or only the peers
it talks to with `TORCH_GLOO_LAZY_INIT=1`.

- a queue `k` (`queue_push`, `queue_pop`, `queue_len`) is one etcd key per item,
  `<prefix>k\\0\\2<unique id>`, popped in the order etcd created them: a push is one put, a pop
  one sorted read of the oldest item plus one guarded delete (another popper that took it first
  costs a retry, so every item is popped exactly once), a length one count. `check` and `wait`
  see a queue with items as an existing key; a blocking pop waits like `get`.

C++ callers reach a Python store through torch's trampoline, which calls Python methods by their
C++ names for some of them (`getNumKeys`, `deleteKey`): both spellings are provided. torch 2.13's
trampoline forwards no queue call, so a wrapper (`PrefixStore`) answers those with c10d's "not
implemented"; the queue is for Python callers.

The trampoline does not own the Python half of a store (pytorch#115977): a C++ holder that
outlives every Python reference (a `PrefixStore`, NCCL's lazily created communicators) would then
reach the base Store and fail ("Not implemented"). So an EtcdStore and its clones stay alive until
`release()`, whoever holds them (`_HELD`); the runtime releases a generation's store when it
closes that generation's groups (`ParallelGroups.close`). A store is a few hundred bytes.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .client import TRANSIENT_ERRORS
from .etcd_api import Compare, EtcdClient, TxnOp, TxnResponse
from .store_keys import (
    _DELTA,
    _END,
    _FOLD_MAX,
    _KEEP_LIMIT,
    _MULTI_SET_CHUNK,
    _QUEUE,
    _QUEUE_END,
    FOLD_EVERY,
    _as_bytes,
    _Counter,
    _logical,
    _note,
)
from .store_relay import StoreRelayClient, StoreRelayError
from .store_waits import wait_for

log = logging.getLogger(__name__)

_DEFAULT_TIMEOUT = timedelta(seconds=300)
_HELD: dict[int, EtcdStore] = {}
"""Every EtcdStore of this process not yet released, by id (module doc: why)."""


_KeySet = set[bytes]  # `set` means the Store method inside the class body


class EtcdStore(dist.Store):
    """A c10d Store whose keys live under `prefix` in etcd (module doc: one request a call)."""

    def __init__(
        self, client: EtcdClient, prefix: str, *, timeout: timedelta = _DEFAULT_TIMEOUT,
        relay: StoreRelayClient | None = None,
    ) -> None:
        """`relay`: the node's store relay, which sends `set`s and reads in transactions shared
        with the node's other workers (`store_relay.py`); None: every request direct."""
        super().__init__()
        if not prefix.endswith("/"):
            raise ValueError(f"store prefix must end with '/', got {prefix!r}")
        self.client = client
        self.prefix = prefix
        self._timeout = timeout
        self._relay = relay
        self._relay_warned = False
        self._family: list[EtcdStore] = [self]
        """This store and its clones: they live and are released together."""
        self._requests = [0]
        """etcd requests made on this store and its clones (shared, counted under `_count_lock`):
        a kept value is good while it has not moved."""
        self._count_lock = threading.Lock()
        self._kept = threading.local()
        """Per thread: (`_requests` when kept, {etcd key: value}) of its last `wait` that found
        every key (module doc)."""
        _HELD[id(self)] = self

    # -- torch.distributed.Store API -------------------------------------------------------

    def set(self, key: str, value: Any) -> None:
        full = self._key(key)
        if self._relay is not None:
            try:
                self._relay.set(full, _as_bytes(value))
                self._count_request()
                return
            except StoreRelayError as exc:
                self._relay_failed(exc)
        txn = self.client.transactions
        self._txn(
            compare=[], success=[txn.delete(full + _DELTA, full + _END), txn.put(full, _as_bytes(value))]
        )

    def get(self, key: str) -> bytes:
        value = self._kept_or_read(key)
        while value is None:
            self.wait([key])
            value = self._kept_or_read(key)  # None only if deleted again since the wait
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        while True:
            self.wait(list(keys))
            txn = self.client.transactions
            _, responses = self._txn(
                compare=[], success=[txn.get(self._key(k), self._key(k) + _END) for k in keys]
            )
            values = [_Counter(self._key(k), r).value(k) for k, r in zip(keys, responses, strict=True)]
            if all(v is not None for v in values):
                return [v for v in values if v is not None]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys and {len(values)} values")
        txn = self.client.transactions
        pairs = list(zip(keys, values, strict=True))
        for i in range(0, len(pairs), _MULTI_SET_CHUNK):
            ops = []
            for k, v in pairs[i : i + _MULTI_SET_CHUNK]:
                full = self._key(k)
                ops += [txn.delete(full + _DELTA, full + _END), txn.put(full, _as_bytes(v))]
            self._txn(compare=[], success=ops)

    def add(self, key: str, value: int) -> int:
        full, txn = self._key(key), self.client.transactions
        delta = f"{full}{_DELTA}{uuid.uuid4().hex}"
        _, responses = self._txn(
            compare=[], success=[txn.get(full, full + _END), txn.put(delta, str(int(value)))]
        )
        seen = _Counter(full, responses[0])
        total = seen.total(key) + int(value)
        if len(seen.deltas) + 1 == FOLD_EVERY:  # exactly one adder per FOLD_EVERY deltas folds
            seen.deltas.append((delta, int(value)))
            self._fold(full, seen, key)
        return total

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        full, txn = self._key(key), self.client.transactions
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        no_deltas = txn.version(full + _DELTA, full + _END) == 0
        # Same contract as TCPStore: an empty `expected` matches a missing key.
        guard = txn.create(full) == 0 if expected == b"" else txn.value(full) == expected
        while True:
            ok, responses = self._txn(
                compare=[guard, no_deltas],
                success=[txn.put(full, desired)],
                failure=[txn.get(full, full + _END)],
            )
            if ok:
                return desired
            found = _Counter(full, responses[0])
            current = found.value(key)
            if current is None:
                if expected != b"":
                    return expected
                continue  # only deltas, deleted since: the key is missing now, try again
            if current != expected or not found.deltas:
                return current
            self._fold(full, found, key)  # a counter equal to `expected`: fold, then swap

    def append(self, key: str, value: Any) -> None:
        """Append `value` to `key`'s value (a missing key starts empty): a read and a write
        guarded on what was read, again if another writer got there in between."""
        full, txn = self._key(key), self.client.transactions
        suffix = _as_bytes(value)
        while True:
            found = self._read(key)
            if found.deltas:  # a counter: its sum becomes the value first
                self._fold(full, found, key)
                continue
            unchanged = txn.mod(full) == found.base_mod if found.base is not None else txn.create(full) == 0
            no_deltas = txn.version(full + _DELTA, full + _END) == 0
            ok, _ = self._txn(compare=[unchanged, no_deltas], success=[txn.put(full, (found.base or b"") + suffix)])
            if ok:
                return

    def has_extended_api(self) -> bool:
        """`append`, `multi_get` and `multi_set` are this store's own (c10d asks before using them)."""
        return True

    def delete_key(self, key: str) -> bool:
        full, txn = self._key(key), self.client.transactions
        _, responses = self._txn(
            compare=[], success=[txn.delete(full), txn.delete(full + _DELTA, full + _END)]
        )
        return any(int(r.response_delete_range.deleted) > 0 for r in responses)

    def check(self, keys: list[str]) -> bool:
        missing, _, _ = self._present([self._key(k) for k in keys])
        return not missing

    def num_keys(self) -> int:
        resp = self._etcd.get_prefix_response(self.prefix, keys_only=True)
        return len({_logical(kv.key) for kv in resp.kvs})

    def clone(self) -> EtcdStore:
        """Another handle on the same keys (torch hands clones to other threads); a subclass
        keeps its type and state, an `AbortableStore` its abort flag."""
        twin = type(self).__new__(type(self))
        dist.Store.__init__(twin)
        twin.__dict__.update(self.__dict__)  # `_family` is shared, not copied
        # A clone asked for from C++ (PrefixStore.clone) is held there without its Python half
        # (pytorch#115977): it is held here until the family is released.
        self._family.append(twin)
        _HELD[id(twin)] = twin
        return twin

    def release(self) -> None:
        """Stop keeping this store and its clones alive for C++ holders (module doc): call it
        once no group or wrapper built on them is used again. Python references still work."""
        for member in self._family:
            _HELD.pop(id(member), None)

    # -- the queue API (module doc) --------------------------------------------------------

    def queue_push(self, key: str, value: Any) -> None:
        self._etcd.put(f"{self._key(key)}{_QUEUE}{uuid.uuid4().hex}", _as_bytes(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        deadline = time.monotonic() + self._timeout.total_seconds()
        full, txn = self._key(key), self.client.transactions
        while True:
            oldest = self._etcd.get_range_response(
                full + _QUEUE, full + _QUEUE_END, sort_order="ascend", sort_target="create", limit=1
            ).kvs
            if oldest:
                item = oldest[0]
                ok, _ = self._txn(compare=[txn.version(item.key.decode()) > 0], success=[txn.delete(item.key.decode())])
                if ok:
                    return bytes(item.value)
                continue  # another popper took it first
            if not block:
                raise dist.QueueEmptyError(f"queue {key!r} under {self.prefix} is empty")
            self.wait([key], timedelta(seconds=max(0.0, deadline - time.monotonic())))

    def queue_len(self, key: str) -> int:
        full = self._key(key)
        return int(self._etcd.get_range_response(full + _QUEUE, full + _QUEUE_END, count_only=True).count)

    def getNumKeys(self) -> int:  # noqa: N802  (the name torch's C++ trampoline calls)
        return self.num_keys()

    def deleteKey(self, key: str) -> bool:  # noqa: N802  (the name torch's C++ trampoline calls)
        return self.delete_key(key)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout if timeout is not None else self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        while True:
            try:
                if self._wait_once([self._key(k) for k in keys], deadline):
                    return
            except TRANSIENT_ERRORS:
                pass  # etcd restarting: retry until the deadline
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(
                    f"Wait timeout after {limit:.1f} s: keys {keys} still missing under {self.prefix}"
                )
            time.sleep(0.05)

    # -- helpers ---------------------------------------------------------------------------

    def delete_prefix(self) -> None:
        """Remove every key of this store (drop an old generation's rendezvous state)."""
        self._etcd.delete_prefix(self.prefix)

    def _key(self, key: str) -> str:
        return self.prefix + key

    @property
    def _etcd(self) -> EtcdClient:
        """The client, for a request: the values a `wait` kept are stale from here on."""
        self._count_request()
        return self.client

    def _count_request(self) -> None:
        """A request was made on the store (direct or relayed): kept values are stale."""
        with self._count_lock:
            self._requests[0] += 1

    def _relay_failed(self, exc: StoreRelayError) -> None:
        """The relay failed a request: this one goes direct (logged once a store)."""
        if not self._relay_warned:
            self._relay_warned = True
            log.warning("%s; the request goes direct", exc)

    def _kept_or_read(self, key: str) -> bytes | None:
        """`key`'s value as this thread's last `wait` kept it, if no request was made on the store
        since (module doc), else as read now; None when it is missing."""
        kept = getattr(self._kept, "values", None)
        if kept is None or kept[0] != self._requests[0]:
            self._kept.values = None
        elif (value := kept[1].pop(self._key(key).encode(), None)) is not None:
            return value
        return self._read(key).value(key)

    def _txn(
        self, *, compare: list[Compare], success: list[TxnOp], failure: list[TxnOp] | None = None
    ) -> tuple[bool, list[TxnResponse]]:
        """One etcd transaction (python3-etcd3 wants every branch as a list)."""
        ok, responses = self._etcd.transaction(compare=compare, success=success, failure=failure or [])
        return bool(ok), responses

    def _read(self, key: str) -> _Counter:
        full = self._key(key)
        if self._relay is not None:
            try:
                _, (read,) = self._relay.read([full])
                self._count_request()
                if not read.more:  # else a counter of many deltas: read it whole, directly
                    return _Counter(full, [(kv.value, kv) for kv in read.kvs])
            except StoreRelayError as exc:
                self._relay_failed(exc)
        resp = self._etcd.get_range_response(full, full + _END)
        return _Counter(full, [(kv.value, kv) for kv in resp.kvs])

    def _fold(self, full: str, seen: _Counter, key: str) -> bool:
        """Move the deltas `seen` holds into the value, if none of them nor the value changed since.

        A failed fold is harmless (another fold, a `set` or a `delete_key` got there first); the
        deltas it meant to fold stay counted where they are.
        """
        txn = self.client.transactions
        folded = seen.deltas[:_FOLD_MAX]
        base_unchanged = txn.mod(full) == seen.base_mod if seen.base is not None else txn.create(full) == 0
        total = (int(seen.base) if seen.base is not None else 0) + sum(d for _, d in folded)
        ok, _ = self._txn(
            compare=[base_unchanged, *[txn.version(k) > 0 for k, _ in folded]],
            success=[txn.put(full, str(total)), *[txn.delete(k) for k, _ in folded]],
        )
        return bool(ok)

    def _present(self, full_keys: list[str]) -> tuple[_KeySet, int, dict[bytes, bytes]]:
        """The keys of `full_keys` that do not exist, the etcd revision of those reads, and what
        `get` would return for those that do (one range read each)."""
        missing: _KeySet = _KeySet()
        values: dict[bytes, bytes] = {}
        if self._relay is not None:
            try:
                revision, reads = self._relay.read(full_keys)
                self._count_request()
                for k, read in zip(full_keys, reads, strict=True):
                    _note(k, read.count, read.more, read.kvs, missing, values)
                return missing, revision, values
            except StoreRelayError as exc:
                self._relay_failed(exc)
        revision = 0
        for k in full_keys:
            resp = self._etcd.get_range_response(k, k + _END, limit=_KEEP_LIMIT)
            revision = max(revision, int(resp.header.revision))
            _note(k, int(resp.count), bool(resp.more), resp.kvs, missing, values)
        return missing, revision, values

    def _wait_once(self, full_keys: list[str], deadline: float) -> bool:
        """True when all keys exist; False when the deadline passed first."""
        missing, revision, values = self._present(full_keys)
        if not missing:
            self._kept.values = (self._requests[0], values)
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        watched = wait_for(
            self.client, self.prefix, missing, revision, remaining, logical=_logical,
            recheck=lambda: self._present(full_keys)[0],
        )
        if watched is None:
            return False
        self._kept.values = (self._requests[0], {**values, **watched})
        return True
