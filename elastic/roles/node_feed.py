"""A node's records from etcd read once: the agent watches, its workers subscribe (issue 34).

Every worker follows three prefixes of its job: the generation records (`plan/`), the halts and
the last step's decisions. Watched from etcd by each worker, a record reaches etcd's egress once a
worker: the generation record after a loss is about 90 B a node, so at 2,048 nodes x 8 GPUs one
change sends 185 KB to 16,384 watchers, 3 GB (bench/README.md, "What fans out to every worker").
Here a node's agent watches each prefix once (`FeedHub`, on its etcd client's one Watch stream)
and hands the events to its workers over the node relay's socket: 2,048 copies, one a node.

A worker asks with one connection per prefix (`subscribe`): the first line `{"watch": prefix}`.
The agent answers with what is under the prefix now (one put event per key, at its revision)
and then every change after it, in revision order, one JSON line a batch:
`{"events": [[kind, key, value, revision], ...]}` (a value's bytes as UTF-8, any other byte
escaped: `surrogateescape`). These are `watch_from_now`'s semantics, which the worker's feeds
(`elastic/roles/control.py`) expect; their records are unchanged.

Each subscriber has a sender thread of its own, so a stopped worker (SIGSTOP) delays nobody. If
the agent goes away while the worker lives on (the agent's relay closed first), the worker's
subscription goes on from etcd directly, from the revision after the last event it was given;
without a relay ($ELASTIC_NODE_RELAY unset: torchrun's workers), or when it does not answer, the
worker watches etcd itself from the start.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import socket
import threading

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.watch import Cancelable, OnEvents, Subscribe, WatchEvent, watch_from_now

log = logging.getLogger(__name__)


def encode_events(events: list[WatchEvent]) -> bytes:
    """One wire line of `events`."""
    rows = [[ev.kind, ev.key, ev.value.decode("utf-8", "surrogateescape"), ev.revision] for ev in events]
    return json.dumps({"events": rows}).encode() + b"\n"


def decode_events(line: bytes) -> list[WatchEvent]:
    """The events of one wire line (ValueError, TypeError or KeyError when it is not one)."""
    rows = json.loads(line)["events"]
    return [WatchEvent(kind="delete" if kind == "delete" else "put", key=str(key),
                       value=str(value).encode("utf-8", "surrogateescape"), prev_value=None, revision=int(rev))
            for kind, key, value, rev in rows]


class _Subscriber:
    """One worker's subscription on the agent's side: its lines go out from a thread of its own."""

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
    """The agent's one watch of `prefix`, its mirror of the keys there, and the node's subscribers."""

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._mirror: dict[str, WatchEvent] = {}
        self._subscribers: set[_Subscriber] = set()
        self._watch = watch_from_now(client, prefix, self._on_events)

    def _on_events(self, events: list[WatchEvent]) -> None:
        line = encode_events(events)
        with self._lock:
            for ev in events:
                if ev.kind == "put":
                    self._mirror[ev.key] = ev
                else:
                    self._mirror.pop(ev.key, None)
            for sub in self._subscribers:
                sub.lines.put(line)

    def serve(self, conn: socket.socket) -> None:
        """Feed `conn` (the worker's subscription) until it closes; returns then."""
        sub = _Subscriber(conn)
        with self._lock:
            now = sorted(self._mirror.values(), key=lambda ev: ev.revision)
            sub.lines.put(encode_events(now))
            self._subscribers.add(sub)
        try:
            while conn.recv(4096):  # the worker sends nothing more; EOF when it goes
                pass
        except OSError:
            pass
        finally:
            with self._lock:
                self._subscribers.discard(sub)
            sub.stop()

    def close(self) -> None:
        self._watch.cancel()
        with self._lock:
            subs, self._subscribers = list(self._subscribers), set()
        for sub in subs:
            sub.stop()


class RelayedWatch:
    """A worker's subscription to one prefix through its node's relay (see the module doc)."""

    def __init__(self, client: EtcdClient, relay: str, prefix: str, on_events: OnEvents, *,
                 timeout_s: float = 30.0) -> None:
        self._client, self._prefix, self._on_events = client, prefix, on_events
        self._last = 0
        """The revision of the last event delivered."""
        self._stop = threading.Event()
        self._direct: Cancelable | None = None
        self._lock = threading.Lock()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(timeout_s)
            conn.connect("\0" + relay)
            conn.sendall(json.dumps({"watch": prefix}).encode() + b"\n")
            self._lines = conn.makefile("rb")
            self._deliver(decode_events(self._read()))  # what is there now, on the calling thread
            conn.settimeout(None)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._thread = threading.Thread(target=self._run, name=f"feed:{prefix}", daemon=True)
        self._thread.start()

    def _read(self) -> bytes:
        line = self._lines.readline()
        if not line.endswith(b"\n"):
            raise OSError("the relay closed the subscription")
        return line

    def _deliver(self, events: list[WatchEvent]) -> None:
        events = [ev for ev in events if ev.revision > self._last]
        if events:
            self._on_events(events)
            self._last = events[-1].revision

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._deliver(decode_events(self._read()))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            if self._stop.is_set():
                return
            log.warning("feed %s: the node relay stopped (%s); watching etcd directly", self._prefix, exc)
        with self._lock:
            if not self._stop.is_set():
                self._direct = watch_from_now(self._client, self._prefix, self._deliver)

    def cancel(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._conn.shutdown(socket.SHUT_RDWR)
        self._conn.close()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)
        with self._lock:
            if self._direct is not None:
                self._direct.cancel()


def subscriber(client: EtcdClient, relay: str | None) -> Subscribe:
    """How a worker follows a prefix: through its node's relay when there is one (falling back to
    etcd when the relay does not answer), else from etcd directly."""

    def subscribe(prefix: str, on_events: OnEvents) -> Cancelable:
        if relay is not None:
            try:
                return RelayedWatch(client, relay, prefix, on_events)
            except (OSError, ValueError, TypeError, KeyError) as exc:
                log.warning("feed %s: no node relay (%s); watching etcd directly", prefix, exc)
        return watch_from_now(client, prefix, on_events)

    return subscribe
