"""One etcd Watch stream per client, shared by every `PrefixWatch` made with that client.

etcd's Watch RPC multiplexes watchers: each create request on a stream carries a watch id, and
every answer names the id it is for. A gRPC stream costs a Python client more than its messages:
the thread that iterates it wakes every 0.1 s (grpc's `_common.wait`) and takes the GIL, idle or
not. With a stream a watch, a worker's three watches cost 30 wake-ups a second, and a host of
simulated workers (bench/control_plane_scale.py, W = 1024: about 3,100 streams in 8 processes)
spent its two cores in them. Here a client has one stream and one thread that reads it, whatever
the number of its watches; each watch hands what it receives to a thread of its own, blocked on
a queue (free while idle), so a slow callback still holds up only its own watch.

When the stream breaks, every watch resumes on a new one (after `fail_over`: another member, with
several) from the revision after the last event it received. A watch whose history was compacted
resumes alone, on the same stream, from what is left. The stream closes, and its thread ends,
when the client's last watch is cancelled.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from typing import Any, Protocol

import grpc
from etcd3 import etcdrpc
from etcd3.utils import prefix_range_end

from .client import TRANSIENT_ERRORS, fail_over
from .etcd_api import EtcdClient

log = logging.getLogger(__name__)


class Watcher(Protocol):
    """What the stream needs of a watch (`PrefixWatch`). It watches the keys under `prefix`, or,
    if it has a `range_end` attribute (bytes), the keys in [`prefix`, `range_end`)."""

    prefix: bytes
    prev_kv: bool
    retry_pause: float

    def resume_revision(self) -> int | None:
        """The revision to (re)start from: after the last event received; None: from now."""
        ...

    def compacted(self, revision: int) -> None:
        """History before `revision` is gone: resume from there."""
        ...

    def created(self, revision: int) -> None:
        """The watch is established at store revision `revision`."""
        ...

    def received(self, events: list[Any]) -> None:
        """Raw events (`etcdrpc` `Event`s), in revision order; called on the stream's thread."""
        ...

    def disconnected(self) -> None:
        """The stream broke (it is being re-established)."""
        ...


class WatchStream:
    """The Watch stream of one client and the thread that reads it (see the module docstring)."""

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._watchers: dict[int, Watcher] = {}
        """The watches wanted, by id(), in the order they were added (a process waiting on many
        store keys has a watch a key: adding and removing one costs O(1))."""
        self._ids: dict[int, Watcher] = {}
        """The open stream's watch ids (etcd's: unique on the stream, never reused)."""
        self._wid: dict[int, int] = {}
        """id() of a watcher -> its watch id in `_ids`."""
        self._pending: collections.deque[Watcher | None] = collections.deque()
        """The creates sent and not yet answered, in order (None: cancelled meanwhile). etcd
        answers a stream's creates in the order they came, each before any event of its watch,
        and chooses the id (this etcd3's protocol has no field for the client to choose it)."""
        self._pending_ids: collections.Counter[int] = collections.Counter()
        """id() of each watcher in `_pending`."""
        self._requests: queue.SimpleQueue[Any] | None = None
        self._compaction_logged = 0
        """The compaction revision last logged."""
        self._call: Any = None
        self._hung_up = False
        """The open call was cancelled here, because the last watch went: no fail-over."""
        self.closed = False
        self._thread = threading.Thread(target=self._run, name="etcd-watch-stream", daemon=True)

    def add(self, watcher: Watcher) -> None:
        """Start delivering to `watcher` (on the open stream at once, or when it opens)."""
        with self._lock:
            self._watchers[id(watcher)] = watcher
            if self._requests is not None:
                self._create(watcher)
            if not self._thread.is_alive() and self._thread.ident is None:
                self._thread.start()

    def remove(self, watcher: Watcher) -> None:
        """Stop delivering to `watcher`; with no watch left, hang up."""
        with self._lock:
            self._watchers.pop(id(watcher), None)
            wid = self._wid.pop(id(watcher), None)
            if wid is not None:
                del self._ids[wid]
                self._cancel(wid)
            if self._pending_ids.pop(id(watcher), 0):  # cancelled before etcd answered its create
                self._pending = collections.deque(None if w is watcher else w for w in self._pending)
            if not self._watchers and self._call is not None:
                self._hung_up = True
                self._call.cancel()

    def _create(self, watcher: Watcher) -> None:
        """Send `watcher`'s create request on the open stream (holding the lock)."""
        assert self._requests is not None
        self._pending.append(watcher)
        self._pending_ids[id(watcher)] += 1
        end = getattr(watcher, "range_end", None) or prefix_range_end(watcher.prefix)
        create = etcdrpc.WatchCreateRequest(key=watcher.prefix, range_end=end, prev_kv=watcher.prev_kv)
        start = watcher.resume_revision()
        if start is not None:
            create.start_revision = start
        self._requests.put(etcdrpc.WatchRequest(create_request=create))

    def _cancel(self, wid: int) -> None:
        """Ask etcd to end watch `wid` of the open stream (holding the lock)."""
        if self._requests is not None:
            self._requests.put(etcdrpc.WatchRequest(cancel_request=etcdrpc.WatchCancelRequest(watch_id=wid)))

    def _run(self) -> None:
        while True:
            with _registry_lock, self._lock:
                if not self._watchers:
                    self.closed = True
                    if _streams.get(self._client) is self:
                        del _streams[self._client]
                    return
                pause = min(w.retry_pause for w in self._watchers.values())
            try:
                self._serve()
            except grpc.RpcError as exc:
                if not self._hung_up:
                    log.debug("watch stream broke: %s", exc.code() if hasattr(exc, "code") else exc)
                    fail_over(self._client)
            except TRANSIENT_ERRORS as exc:  # no member available right now (`channel` raised)
                log.debug("watch stream: %s", type(exc).__name__)
            except Exception:  # a bug must not end every watch of the client silently
                log.exception("watch stream failed")
            with self._lock:
                if self._requests is not None:
                    self._requests.put(None)  # ends the request iterator
                self._requests, self._call, self._hung_up = None, None, False
                self._ids.clear()
                self._wid.clear()
                self._pending.clear()
                self._pending_ids.clear()
                watchers = list(self._watchers.values())
            for w in watchers:
                w.disconnected()
            if watchers:
                threading.Event().wait(pause)

    def _serve(self) -> None:
        requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        stub = etcdrpc.WatchStub(self._client.channel)
        call = stub.Watch(
            iter(requests.get, None), credentials=self._client.call_credentials, metadata=self._client.metadata
        )
        with self._lock:
            self._requests, self._call = requests, call
            if not self._watchers:
                self._hung_up = True
                call.cancel()
            for w in self._watchers.values():
                self._create(w)
        for rs in call:
            with self._lock:
                if rs.created:
                    watcher = self._pending.popleft() if self._pending else None
                    if watcher is None:  # cancelled before etcd answered
                        self._cancel(rs.watch_id)
                        continue
                    self._pending_ids[id(watcher)] -= 1
                    if not self._pending_ids[id(watcher)]:
                        del self._pending_ids[id(watcher)]
                    self._ids[rs.watch_id] = watcher
                    self._wid[id(watcher)] = rs.watch_id
                watcher = self._ids.get(rs.watch_id)
                if watcher is None:  # cancelled here; etcd's answers to it may still come
                    continue
                if rs.compact_revision:
                    # History it had not received yet was compacted: it resumes from what is left.
                    # Logged once a compaction a stream (a process waiting on many store keys has
                    # a watch a key, and one compaction can reach thousands of them).
                    if rs.compact_revision > self._compaction_logged:
                        self._compaction_logged = rs.compact_revision
                        log.warning("watch on %s lost history up to revision %d (and any other watch of "
                                    "this stream with it)", watcher.prefix, rs.compact_revision)
                    del self._ids[rs.watch_id]
                    self._wid.pop(id(watcher), None)
                    watcher.compacted(rs.compact_revision)
                    self._create(watcher)
                    continue
                if rs.canceled:  # refused (etcd says why): every watch starts over on a new stream
                    log.warning("etcd cancelled the watch on %s: %s", watcher.prefix, rs.cancel_reason)
                    return
            if rs.created:
                watcher.created(rs.header.revision)
            if rs.events:
                watcher.received(list(rs.events))


_registry_lock = threading.Lock()
_streams: dict[EtcdClient, WatchStream] = {}
"""The open stream of each client with a watch (a stream leaves when its last watch does)."""


def subscribe(client: EtcdClient, watcher: Watcher) -> WatchStream:
    """Deliver `client`'s changes under `watcher.prefix` to `watcher`, on the client's stream."""
    with _registry_lock:
        stream = _streams.get(client)
        if stream is None or stream.closed:
            stream = _streams[client] = WatchStream(client)
        stream.add(watcher)
    return stream
