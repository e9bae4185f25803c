"""A prefix watch that survives etcd restarts and never skips an event.

python3-etcd3's own watcher dies silently when its stream breaks (and its error path refers to
a module it does not import), so this module speaks etcd's Watch RPC directly: one background
thread per watch, resuming from the revision after the last delivered event whenever the stream
breaks. Callbacks run on that thread, in revision order. With several etcd members the resumed
stream goes to another member (`client.fail_over`): every member serves the same revisions.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import kv_pb2
from etcd3.utils import prefix_range_end

from .client import TRANSIENT_ERRORS, fail_over
from .etcd_api import EtcdClient

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class WatchEvent:
    """One change of one key."""

    kind: Literal["put", "delete"]
    """Whether the key was written or deleted (deleted includes lease expiry and revocation)."""
    key: str
    """Full key."""
    value: bytes
    """New value (empty for a delete)."""
    prev_value: bytes | None
    """Value before the change, when etcd still had it and the watch asked for it (`prev_kv`)."""
    revision: int
    """etcd revision of the change."""


class PrefixWatch:
    """Calls `on_events(events)` for every change under `prefix` from `start_revision` on."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        on_events: Callable[[list[WatchEvent]], None],
        *,
        start_revision: int | None = None,
        on_connection: Callable[[bool], None] | None = None,
        retry_pause: float = 0.1,
        prev_kv: bool = False,
    ) -> None:
        """`prev_kv`: deliver each change's previous value too (etcd then reads it for every
        event and watcher: only for watchers that need it)."""
        self._client = client
        self._prev_kv = prev_kv
        self._prefix = prefix.encode()
        self._on_events = on_events
        self._on_connection = on_connection
        self._retry_pause = retry_pause
        self._next_revision = start_revision
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._call: Any = None
        self._lock = threading.Lock()
        self.connected = False
        self._thread = threading.Thread(target=self._run, name=f"watch:{prefix}", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float) -> bool:
        """True once the first watch stream is established."""
        return self._ready.wait(timeout)

    @property
    def next_revision(self) -> int | None:
        """The revision the watch would resume from."""
        return self._next_revision

    def cancel(self) -> None:
        """Stop watching; no callback runs after this returns (except one already running)."""
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

    def _requests(self, create: Any) -> Iterator[Any]:
        yield etcdrpc.WatchRequest(create_request=create)
        self._stop.wait()

    def _set_connected(self, up: bool) -> None:
        if up != self.connected:
            self.connected = up
            if self._on_connection is not None:
                self._on_connection(up)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._stream()
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    break
                log.debug("watch on %s broke: %s", self._prefix, exc.code() if hasattr(exc, "code") else exc)
                fail_over(self._client)
            except TRANSIENT_ERRORS as exc:  # no member available right now (`channel` raised)
                log.debug("watch on %s: %s", self._prefix, type(exc).__name__)
            except Exception:  # a bug in a callback must not end the watch silently
                log.exception("watch on %s failed", self._prefix)
            self._set_connected(False)
            self._stop.wait(self._retry_pause)

    def _stream(self) -> None:
        create = etcdrpc.WatchCreateRequest(
            key=self._prefix, range_end=prefix_range_end(self._prefix), prev_kv=self._prev_kv
        )
        if self._next_revision is not None:
            create.start_revision = self._next_revision
        stub = etcdrpc.WatchStub(self._client.channel)
        call = stub.Watch(
            self._requests(create), credentials=self._client.call_credentials, metadata=self._client.metadata
        )
        with self._lock:
            self._call = call
        if self._stop.is_set():
            call.cancel()
            return
        for rs in call:
            if rs.created:
                if self._next_revision is None:
                    self._next_revision = rs.header.revision + 1
                self._set_connected(True)
                self._ready.set()
            if rs.compact_revision:
                # History we had not seen yet was compacted: resume from what is left.
                log.warning("watch on %s lost history up to revision %d", self._prefix, rs.compact_revision)
                self._next_revision = rs.compact_revision
                return
            if rs.canceled:
                return
            if rs.events:
                events = [_convert(ev) for ev in rs.events]
                self._next_revision = events[-1].revision + 1
                self._on_events(events)


def _convert(ev: Any) -> WatchEvent:
    return WatchEvent(
        kind="delete" if ev.type == kv_pb2.Event.DELETE else "put",
        key=ev.kv.key.decode(),
        value=ev.kv.value,
        prev_value=ev.prev_kv.value if ev.HasField("prev_kv") else None,
        revision=ev.kv.mod_revision,
    )


def watch_from_now(
    client: EtcdClient, prefix: str, on_events: Callable[[list[WatchEvent]], None], **kwargs: Any
) -> PrefixWatch:
    """Deliver what is under `prefix` now (one put event per key, at its mod revision, on the
    calling thread) and then every change after that read (a PrefixWatch from the read's revision
    + 1; `kwargs` go to it). The way to mirror a prefix under auto-compaction: a watch from an
    old revision (such as 1) misses every key last written before the compacted revision."""
    resp = client.get_prefix_response(prefix)
    current = [WatchEvent(kind="put", key=kv.key.decode(), value=kv.value, prev_value=None,
                          revision=kv.mod_revision) for kv in resp.kvs]
    if current:
        on_events(current)
    return PrefixWatch(client, prefix, on_events, start_revision=int(resp.header.revision) + 1, **kwargs)
