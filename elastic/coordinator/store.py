"""An etcd-backed `torch.distributed.Store`, one key prefix per generation.

    store = EtcdStore(client, keys.store(f"gen-{g}"), timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)

No worker hosts the rendezvous (unlike TCPStore, whose host takes the store down with it), and a
new generation gets a fresh prefix, so stale keys of a broken group can never confuse the next.
Blocking calls (`get` of a missing key, `wait`) watch etcd from the revision at which the keys
were seen missing, so they wake on the write itself rather than on a polling tick, and raise
`torch.distributed.DistStoreError` when the timeout passes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import grpc
import torch.distributed as dist
from etcd3 import etcdrpc
from etcd3.utils import prefix_range_end

from .client import TRANSIENT_ERRORS

_DEFAULT_TIMEOUT = timedelta(seconds=300)


def _as_bytes(value: str | bytes | bytearray | list[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class EtcdStore(dist.Store):
    """A c10d Store whose keys live under `prefix` in etcd."""

    def __init__(self, client: Any, prefix: str, *, timeout: timedelta = _DEFAULT_TIMEOUT) -> None:
        super().__init__()
        if not prefix.endswith("/"):
            raise ValueError(f"store prefix must end with '/', got {prefix!r}")
        self.client = client
        self.prefix = prefix
        self._timeout = timeout

    # -- torch.distributed.Store API -------------------------------------------------------

    def set(self, key: str, value: Any) -> None:
        self.client.put(self._key(key), _as_bytes(value))

    def get(self, key: str) -> bytes:
        value, _ = self.client.get(self._key(key))
        if value is None:
            self.wait([key])
            value, _ = self.client.get(self._key(key))
            assert value is not None, f"key {key!r} vanished after wait"
        return bytes(value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(list(keys))
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys and {len(values)} values")
        txn = self.client.transactions
        self.client.transaction(
            compare=[],
            success=[txn.put(self._key(k), _as_bytes(v)) for k, v in zip(keys, values, strict=True)],
            failure=[],
        )

    def add(self, key: str, value: int) -> int:
        txn = self.client.transactions
        full = self._key(key)
        while True:
            current, meta = self.client.get(full)
            new = (int(current) if current is not None else 0) + int(value)
            guard = txn.create(full) == 0 if meta is None else txn.mod(full) == meta.mod_revision
            ok, _ = self.client.transaction(compare=[guard], success=[txn.put(full, str(new))], failure=[])
            if ok:
                return new

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        txn = self.client.transactions
        full, expected, desired = self._key(key), _as_bytes(expected_value), _as_bytes(desired_value)
        # Same contract as TCPStore: an empty `expected` matches a missing key.
        guard = txn.create(full) == 0 if expected == b"" else txn.value(full) == expected
        ok, responses = self.client.transaction(
            compare=[guard], success=[txn.put(full, desired)], failure=[txn.get(full)]
        )
        if ok:
            return desired
        found = responses[0]
        return bytes(found[0][0]) if found else expected

    def delete_key(self, key: str) -> bool:
        return bool(self.client.delete(self._key(key)))

    def check(self, keys: list[str]) -> bool:
        return all(self.client.get(self._key(k))[0] is not None for k in keys)

    def num_keys(self) -> int:
        resp = self.client.get_prefix_response(self.prefix, count_only=True)
        return int(resp.count)

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
                    f"wait for keys {keys} under {self.prefix} timed out after {limit:.1f} s"
                )
            time.sleep(0.05)

    # -- helpers ---------------------------------------------------------------------------

    def delete_prefix(self) -> None:
        """Remove every key of this store (drop an old generation's rendezvous state)."""
        self.client.delete_prefix(self.prefix)

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _wait_once(self, full_keys: list[str], deadline: float) -> bool:
        """True when all keys exist; False when the deadline passed first."""
        missing: set[bytes] = set()
        revision = 0
        for k in full_keys:
            resp = self.client.get_response(k, keys_only=True)
            revision = max(revision, int(resp.header.revision))
            if resp.count == 0:
                missing.add(k.encode())
        if not missing:
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        # Watch the whole prefix from the revision after our reads: no write can slip between.
        stop = threading.Event()

        def requests() -> Iterator[Any]:
            create = etcdrpc.WatchCreateRequest(
                key=self.prefix.encode(),
                range_end=prefix_range_end(self.prefix.encode()),
                start_revision=revision + 1,
            )
            yield etcdrpc.WatchRequest(create_request=create)
            stop.wait()

        call = etcdrpc.WatchStub(self.client.channel).Watch(
            requests(),
            timeout=remaining,
            credentials=self.client.call_credentials,
            metadata=self.client.metadata,
        )
        try:
            for rs in call:
                for ev in rs.events:
                    if ev.type == 0:  # PUT
                        missing.discard(ev.kv.key)
                if not missing or rs.canceled or rs.compact_revision:
                    break
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
        finally:
            stop.set()
            call.cancel()
        return not missing
