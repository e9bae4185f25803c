"""A prefix watch that survives etcd restarts and never skips an event.

python3-etcd3's own watcher dies silently when its stream breaks (and its error path refers to
a module it does not import), so this module speaks etcd's Watch RPC directly. Every watch of a
client shares the client's one Watch stream (`watch_stream.py`), which resumes each watch from
the revision after the last event it received whenever the stream breaks. A watch's callbacks
run on a thread of its own, in revision order. With several etcd members the resumed stream goes
to another member (`client.fail_over`): every member serves the same revisions.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from etcd3.etcdrpc import kv_pb2

from .etcd_api import EtcdClient
from .watch_stream import subscribe

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


OnEvents = Callable[[list[WatchEvent]], None]
"""A watch's callback: a batch of changes, in revision order."""


class Cancelable(Protocol):
    """A watch, or anything that delivers like one until cancelled."""

    def cancel(self) -> None: ...


Subscribe = Callable[[str, OnEvents], Cancelable]
"""`subscribe(prefix, on_events)` with `watch_from_now`'s semantics: what is under the prefix now
(one put event a key, on the calling thread), then every change after it. `watch_from_now` with
a client is one; a worker's node relay is another (elastic/roles/node_feed.py)."""


class PrefixWatch:
    """Calls `on_events(events)` for every change under `prefix` from `start_revision` on.

    The watch rides its client's one Watch stream (`watch_stream.py`); its callbacks run on a
    thread of its own, in revision order.
    """

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
        self.prefix = prefix.encode()
        self.prev_kv = prev_kv
        self.retry_pause = retry_pause
        self._on_events = on_events
        self._on_connection = on_connection
        self._received = start_revision
        """The revision after the last event received: where a new stream resumes."""
        self._next_revision = start_revision
        """The revision after the last event delivered."""
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._inbox: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self.connected = False
        self._thread = threading.Thread(target=self._deliver, name=f"watch:{prefix}", daemon=True)
        self._thread.start()
        self._stream = subscribe(client, self)

    def wait_ready(self, timeout: float) -> bool:
        """True once the watch is first established."""
        return self._ready.wait(timeout)

    @property
    def next_revision(self) -> int | None:
        """The revision after the last change delivered (every change before it was)."""
        return self._next_revision

    def cancel(self) -> None:
        """Stop watching; no callback runs after this returns (except one already running)."""
        self._stop.set()
        self._stream.remove(self)
        self._inbox.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

    # -- from the stream's thread (watch_stream.Watcher) --

    def resume_revision(self) -> int | None:
        return self._received

    def compacted(self, revision: int) -> None:
        self._received = revision

    def created(self, revision: int) -> None:
        if self._received is None:
            self._received = revision + 1
        self._inbox.put(("created", revision))

    def received(self, events: list[Any]) -> None:
        self._received = int(events[-1].kv.mod_revision) + 1
        self._inbox.put(("events", events))

    def disconnected(self) -> None:
        self._inbox.put(("connection", False))

    # -- on the watch's own thread --

    def _deliver(self) -> None:
        while (item := self._inbox.get()) is not None and not self._stop.is_set():
            kind, value = item
            try:
                if kind == "created":
                    if self._next_revision is None:
                        self._next_revision = value + 1
                    self._set_connected(True)
                    self._ready.set()
                elif kind == "connection":
                    self._set_connected(value)
                else:
                    events = [_convert(ev) for ev in value]
                    try:
                        self._on_events(events)
                    finally:
                        self._next_revision = events[-1].revision + 1
            except Exception:  # a bug in a callback must not end the watch silently
                log.exception("watch on %s: a callback failed", self.prefix.decode())

    def _set_connected(self, up: bool) -> None:
        if up != self.connected:
            self.connected = up
            if self._on_connection is not None:
                self._on_connection(up)


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
    """Deliver what is under `prefix` now (one put event per key, at its mod revision, in
    revision order as a watch would have delivered them, on the calling thread) and then every
    change after that read (a PrefixWatch from the read's revision + 1; `kwargs` go to it). The
    way to mirror a prefix under auto-compaction: a watch from an old revision (such as 1)
    misses every key last written before the compacted revision."""
    resp = client.get_prefix_response(prefix)
    current = sorted((WatchEvent(kind="put", key=kv.key.decode(), value=kv.value, prev_value=None,
                                 revision=kv.mod_revision) for kv in resp.kvs), key=lambda ev: ev.revision)
    if current:
        on_events(current)
    return PrefixWatch(client, prefix, on_events, start_revision=int(resp.header.revision) + 1, **kwargs)
