"""A node's records from etcd read once: the agent watches, its workers subscribe (issue 34).

Every worker follows three prefixes of its job: the generation records (`plan/`), the halts and
the last step's decisions. Watched from etcd by each worker, a record reaches etcd's egress once a
worker: the generation record after a loss is about 90 B a node, so at 2,048 nodes x 8 GPUs one
change sends 185 KB to 16,384 watchers, 3 GB (bench/README.md, "What fans out to every worker").
Here a node's agent watches each prefix once (`FeedHub`, on its etcd client's one Watch stream)
and hands the events to its workers over the node relay's socket: 2,048 copies, one a node.

A worker has one connection to the relay for all its subscriptions (`FeedConnection`), one line
`{"watch": prefix}` a prefix. For each, the agent answers with what is under the prefix now (one
put event per key, at its revision) and then every change after it, in revision order, one JSON
line a batch: `{"prefix": prefix, "events": [[kind, key, value, revision], ...]}` (a value's bytes
as UTF-8, any other byte escaped: `surrogateescape`); the first line of a prefix is what is there
now. These are `watch_from_now`'s semantics, which the worker's feeds (`elastic/roles/worker_feeds.py`)
expect; their records are unchanged. A worker's callbacks run on its connection's one reading
thread (what is there now: on the subscribing thread).

Each worker's connection has a sender thread of its own in the agent, so a stopped worker
(SIGSTOP) delays nobody. If the agent goes away while the worker lives on (the agent's relay
closed first), each subscription goes on from etcd directly, from the revision after the last
event it was given; without a relay ($ELASTIC_NODE_RELAY unset: torchrun's workers), or when it
does not answer, the worker watches etcd itself from the start.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import socket
import threading

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.local_socket import connect_abstract, send_line
from elastic.coordinator.watch import Cancelable, OnEvents, Subscribe, WatchEvent, watch_from_now

log = logging.getLogger(__name__)


def encode_events(prefix: str, events: list[WatchEvent]) -> bytes:
    """One wire line of `events` under `prefix`."""
    rows = [[ev.kind, ev.key, ev.value.decode("utf-8", "surrogateescape"), ev.revision] for ev in events]
    return json.dumps({"prefix": prefix, "events": rows}).encode() + b"\n"


def decode_events(line: bytes) -> tuple[str, list[WatchEvent]]:
    """The prefix and events of one wire line (ValueError, TypeError or KeyError when it is not one)."""
    message = json.loads(line)
    events = [WatchEvent(kind="delete" if kind == "delete" else "put", key=str(key),
                         value=str(value).encode("utf-8", "surrogateescape"), prev_value=None, revision=int(rev))
              for kind, key, value, rev in message["events"]]
    return str(message["prefix"]), events


def watch_request(line: bytes) -> str | None:
    """The prefix of a subscription request line; None for anything else (a put request)."""
    try:
        request = json.loads(line)
    except ValueError:
        return None
    prefix = request.get("watch") if isinstance(request, dict) else None
    return prefix if isinstance(prefix, str) and prefix else None


# ---- the agent's side ------------------------------------------------------------------------


class Outlet:
    """One worker's feed connection, in the agent: its lines go out from a thread of its own."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.lines: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        threading.Thread(target=self._send, name="feed-send", daemon=True).start()

    def _send(self) -> None:
        while (line := self.lines.get()) is not None:
            try:
                self.conn.sendall(line)
            except OSError:  # the worker is gone
                return

    def stop(self) -> None:
        self.lines.put(None)


class FeedHub:
    """The agent's one watch of `prefix`, its mirror of the keys there, and the node's outlets."""

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._mirror: dict[str, WatchEvent] = {}
        self._outlets: set[Outlet] = set()
        self._watch = watch_from_now(client, prefix, self._on_events)

    def _on_events(self, events: list[WatchEvent]) -> None:
        line = encode_events(self.prefix, events)  # once for the node's workers
        with self._lock:
            for ev in events:
                if ev.kind == "put":
                    self._mirror[ev.key] = ev
                else:
                    self._mirror.pop(ev.key, None)
            for outlet in self._outlets:
                outlet.lines.put(line)

    def add(self, outlet: Outlet) -> None:
        """Feed `outlet`: what is there now, then every change."""
        with self._lock:
            outlet.lines.put(encode_events(self.prefix, sorted(self._mirror.values(), key=lambda ev: ev.revision)))
            self._outlets.add(outlet)

    def remove(self, outlet: Outlet) -> None:
        with self._lock:
            self._outlets.discard(outlet)

    def close(self) -> None:
        self._watch.cancel()


# ---- a worker's side -------------------------------------------------------------------------


class _Subscription:
    """One prefix a worker follows through its connection (or, once that is gone, from etcd)."""

    def __init__(self, feed: FeedConnection, prefix: str, on_events: OnEvents) -> None:
        self.feed, self.prefix, self.on_events = feed, prefix, on_events
        self.last = 0
        """The revision of the last event delivered."""
        self.lock = threading.Lock()
        self.now: list[WatchEvent] | None = None
        """What was there when subscribed (the prefix's first line); None until it came."""
        self.came = threading.Event()
        self.ready = False
        """What was there now is delivered: the reading thread delivers from here on."""
        self.pending: list[list[WatchEvent]] = []
        self.orphaned = False
        """The connection went before the subscriber was ready: it falls back itself."""
        self.cancelled = False
        self.direct: Cancelable | None = None

    def deliver(self, events: list[WatchEvent]) -> None:
        events = [ev for ev in events if ev.revision > self.last]
        if events and not self.cancelled:
            self.on_events(events)
            self.last = events[-1].revision

    def fall_back(self) -> None:
        """Go on from etcd: every change after the last one delivered."""
        with self.lock:
            if not self.cancelled:
                self.direct = watch_from_now(self.feed.client, self.prefix, self.deliver)

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            direct = self.direct
        if direct is not None:
            direct.cancel()
        self.feed.drop(self)


class FeedConnection:
    """A worker's one connection to its node's relay, for all the prefixes it follows."""

    def __init__(self, client: EtcdClient, relay: str, *, timeout_s: float = 30.0) -> None:
        self.client, self.relay, self.timeout_s = client, relay, timeout_s
        self._lock = threading.Lock()
        self._subs: dict[str, _Subscription] = {}
        self._conn: socket.socket | None = None
        self._broken = False

    def subscribe(self, prefix: str, on_events: OnEvents) -> Cancelable:
        """Follow `prefix` (`Subscribe`); OSError when the relay does not answer, ValueError when
        this connection already follows `prefix`."""
        sub = _Subscription(self, prefix, on_events)
        with self._lock:
            if self._broken:
                raise OSError("the relay's connection is gone")
            if prefix in self._subs:
                raise ValueError(f"{prefix!r} is already followed on this connection")
            if self._conn is None:
                self._connect()
            assert self._conn is not None
            self._subs[prefix] = sub
            try:
                send_line(self._conn, {"watch": prefix})
            except OSError:
                del self._subs[prefix]
                raise
        if not sub.came.wait(self.timeout_s) or sub.now is None:
            self.drop(sub)
            raise OSError(f"the relay did not answer the subscription to {prefix!r}")
        sub.deliver(sub.now)  # on the calling thread, as watch_from_now does
        while True:  # then what came meanwhile, until the reading thread can take over
            with sub.lock:
                batch, sub.pending = sub.pending, []
                if not batch:
                    sub.ready = True
                    orphaned = sub.orphaned
                    break
            for events in batch:
                sub.deliver(events)
        if orphaned:
            sub.fall_back()
        return sub

    def _connect(self) -> None:
        conn = connect_abstract(self.relay, self.timeout_s)
        conn.settimeout(None)
        self._conn = conn
        threading.Thread(target=self._read, args=(conn,), name="feed-read", daemon=True).start()

    def drop(self, sub: _Subscription) -> None:
        """Forget `sub`; the connection closes with its last subscription."""
        with self._lock:
            if self._subs.get(sub.prefix) is sub:
                del self._subs[sub.prefix]
            conn = self._conn if not self._subs else None
            if conn is not None:
                self._conn, self._broken = None, True
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _read(self, conn: socket.socket) -> None:
        reason = "closed"
        try:
            with conn.makefile("rb") as lines:
                for line in lines:
                    if not line.endswith(b"\n"):
                        break
                    self._dispatch(*decode_events(line))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._broken = True
            subs = list(self._subs.values())
        if subs:
            log.warning("node relay %s: feed connection %s; watching etcd directly", self.relay, reason)
        for sub in subs:
            if not sub.came.is_set():
                sub.came.set()  # its subscribe raises (nothing was delivered): a watch from scratch
                continue
            with sub.lock:
                if not sub.ready:
                    sub.orphaned = True
                    continue
            sub.fall_back()

    def _dispatch(self, prefix: str, events: list[WatchEvent]) -> None:
        with self._lock:
            sub = self._subs.get(prefix)
        if sub is None:
            return
        if not sub.came.is_set():
            sub.now = events
            sub.came.set()
            return
        with sub.lock:
            if not sub.ready:
                sub.pending.append(events)
                return
        sub.deliver(events)


def subscriber(client: EtcdClient, relay: str | None) -> Subscribe:
    """How a worker follows a prefix: through its node's relay when there is one (one connection
    for all it follows; etcd directly for a prefix the relay does not answer), else from etcd."""
    feed = FeedConnection(client, relay) if relay is not None else None

    def subscribe(prefix: str, on_events: OnEvents) -> Cancelable:
        if feed is not None:
            try:
                return feed.subscribe(prefix, on_events)
            except (OSError, ValueError) as exc:
                log.warning("feed %s: not through the node relay (%s); watching etcd directly", prefix, exc)
        return watch_from_now(client, prefix, on_events)

    return subscribe
