"""One etcd LeaseKeepAlive stream per client, shared by every `KeptLease` made with that client.

etcd's LeaseKeepAlive RPC is a stream: each request names a lease, each answer names the lease it
refreshed and its TTL, in the order asked. python3-etcd3's `refresh_lease` opens a new stream for
every refresh (1.55 ms of a Python client's CPU, against 0.35 ms for a refresh on an open stream,
measured); a process with two leases refreshed every TTL/4 paid that several times a second, and
a host of simulated agents (bench/control_plane_scale.py) thousands of times. Here a client keeps
one stream open while any of its leases is kept, and one thread reads its answers.

`refresh(lease_id)` sends one request and waits for its answer. When the stream breaks (etcd
restarts, the member is lost), every waiting refresh fails with a transient error and the next
one opens a new stream, after `fail_over` (another member, with several): `KeptLease` retries as
it did before.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from typing import Any

import grpc
from etcd3 import etcdrpc
from etcd3.exceptions import ConnectionFailedError, ConnectionTimeoutError

from .client import fail_over
from .etcd_api import EtcdClient

log = logging.getLogger(__name__)

REFRESH_TIMEOUT_S = 5.0
"""How long a refresh waits for its answer before it counts as a failed attempt."""


class _Waiter:
    """One refresh sent and not yet answered."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ttl: int | None = None
        """The lease's remaining TTL (<= 0: it had expired); None: the stream broke first."""


class LeaseStream:
    """The LeaseKeepAlive stream of one client, open while any lease uses it (module doc)."""

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._users = 0
        """Leases using the stream (under `_registry_lock`)."""
        self._requests: queue.SimpleQueue[Any] | None = None
        self._call: Any = None
        self._waiting: dict[int, collections.deque[_Waiter]] = {}
        """Per lease id, its refreshes in flight on the open stream, in the order sent."""

    def release(self) -> None:
        """A lease stops using the stream (`kept_stream`); the last one closes it."""
        with _registry_lock:
            self._users -= 1
            if self._users > 0:
                return
            if _streams.get(self._client) is self:
                del _streams[self._client]
        with self._lock:
            if self._call is not None:
                self._call.cancel()

    def refresh(self, lease_id: int, timeout: float = REFRESH_TIMEOUT_S) -> int:
        """Refresh lease `lease_id` once: its TTL (<= 0: it had expired). Raises
        ConnectionFailedError when the stream broke, ConnectionTimeoutError after `timeout`."""
        waiter = _Waiter()
        with self._lock:
            if self._requests is None:
                self._open()
            assert self._requests is not None
            self._waiting.setdefault(lease_id, collections.deque()).append(waiter)
            self._requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease_id))
        if not waiter.done.wait(timeout):
            with self._lock:
                pending = self._waiting.get(lease_id)
                if pending is not None and waiter in pending:
                    pending.remove(waiter)
            raise ConnectionTimeoutError(f"no answer to a refresh of lease {lease_id:x} in {timeout:g} s")
        if waiter.ttl is None:
            raise ConnectionFailedError(f"the lease stream broke during a refresh of lease {lease_id:x}")
        return waiter.ttl

    def _open(self) -> None:
        """Open a stream and the thread that reads it (holding the lock)."""
        requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        stub = etcdrpc.LeaseStub(self._client.channel)
        call = stub.LeaseKeepAlive(
            iter(requests.get, None), credentials=self._client.call_credentials, metadata=self._client.metadata
        )
        self._requests, self._call = requests, call
        threading.Thread(target=self._read, args=(call, requests), name="etcd-lease-stream", daemon=True).start()

    def _read(self, call: Any, requests: queue.SimpleQueue[Any]) -> None:
        try:
            for rs in call:
                with self._lock:
                    pending = self._waiting.get(int(rs.ID))
                    waiter = pending.popleft() if pending else None
                if waiter is not None:
                    waiter.ttl = int(rs.TTL)
                    waiter.done.set()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                log.debug("lease stream broke: %s", exc.code())
                fail_over(self._client)
        except Exception:  # a bug must not leave every refresh of the client waiting
            log.exception("lease stream failed")
        finally:
            requests.put(None)  # ends the request iterator
            with self._lock:
                if self._call is call:
                    self._requests, self._call = None, None
                waiting, self._waiting = self._waiting, {}
            for pending in waiting.values():
                for waiter in pending:
                    waiter.done.set()  # ttl None: the refresh fails, the lease retries


_registry_lock = threading.Lock()
_streams: dict[EtcdClient, LeaseStream] = {}
"""The lease stream of each client with a kept lease (it leaves with the client's last one)."""


def kept_stream(client: EtcdClient) -> LeaseStream:
    """`client`'s lease stream, for one more lease (which calls `release` when it stops)."""
    with _registry_lock:
        stream = _streams.get(client)
        if stream is None:
            stream = _streams[client] = LeaseStream(client)
        stream._users += 1
        return stream
