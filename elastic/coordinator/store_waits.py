"""Blocking waits of `EtcdStore`: one etcd watch per (client, store key), shared by its waits.

A wait that found keys missing at revision R needs the puts after R of those keys, and of nothing
else. Each missing key gets a watch of exactly its etcd range `[k, k\\1)` (its value, an `add`'s
deltas, a queue's items), shared by every wait of the process on that key while any remains:
the first waiter opens it from its own R + 1, later ones join it. A put then wakes only the
processes waiting on that key. (A watch of the whole store prefix, shared by every wait of a
process, was cheaper to open but sent every put to every process with any wait open: a 4,096-rank
lazy gloo rendezvous with a client a rank, as real workers have, made etcd send 1.2 million events,
286 a rank, for 4,096 puts; bench/README.md.)

The watch records the revision of its key's last put, so a waiter that joins late is satisfied by
a put it already passed, provided that put came after the waiter's own read; a waiter whose read
is older than the watch's start re-reads once after joining (the caller's `recheck`), which
covers the gap. A satisfied waiter gets the values of its keys' last puts, when each key's watch
saw every put since the waiter's read and none of them was a counter's delta or a queue's item:
the store keeps them for the caller's next `get`. The watches ride the client's one Watch stream
(`watch_stream.py`) and their events are handled on that stream's thread (a few set operations):
no stream or thread of their own.

If the stream breaks (etcd restarting) or a watch's history was compacted, its waiters are woken
unsatisfied and retry with a new watch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, ClassVar

from .etcd_api import EtcdClient
from .watch_stream import WatchStream, subscribe

_KEY_END = b"\x01"
"""A store key `k`'s etcd keys are `[k, k\\1)` (store.py)."""


class _Waiter:
    """One blocked wait: the keys it still misses, across the watches of all of them."""

    def __init__(self, missing: set[bytes], after: int) -> None:
        self.missing = missing
        self.after = after
        self.lock = threading.Lock()
        self.done = threading.Event()

    def got(self, key: bytes) -> None:
        with self.lock:
            self.missing.discard(key)
            if not self.missing:
                self.done.set()

    def still(self) -> set[bytes]:
        with self.lock:
            return set(self.missing)


class KeyWaits:
    """The shared watch of one store key (module doc); `wait_for` is the whole interface."""

    _live: ClassVar[dict[tuple[int, bytes], KeyWaits]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, client: EtcdClient, key: bytes, start_revision: int) -> None:
        self.client, self.key, self.start_revision = client, key, start_revision
        self.lock = threading.Lock()
        self.waiters: set[_Waiter] = set()
        self.last_put = 0
        """The revision of the key's last put seen (of its value or of a part)."""
        self.last_value: bytes | None = None
        """The value of the key's last put of the key itself seen."""
        self.last_part = 0
        """The revision of the key's last put of a part seen (a counter's delta, a queue's item)."""
        self.broken = False
        self.users = 0
        # What the client's Watch stream asks of a watch (watch_stream.Watcher):
        self.prefix = key
        self.range_end = key + _KEY_END
        self.prev_kv = False
        self.retry_pause = 0.1
        self._stream: WatchStream | None = subscribe(client, self)

    @classmethod
    def wait_for(
        cls,
        client: EtcdClient,
        missing: set[bytes],
        revision: int,
        timeout: float,
        *,
        recheck: Callable[[], set[bytes]],
    ) -> dict[bytes, bytes] | None:
        """Block until every key of `missing` (seen missing at `revision`) was put: then the values
        of the last puts the watches saw of them (those that put the key itself, not a counter's
        delta), for the caller's next `get`. None when `timeout` seconds passed first, or a
        watch broke (the caller retries)."""
        hubs = [cls._join(client, k, revision + 1) for k in sorted(missing)]
        waiter = _Waiter(set(missing), revision)
        try:
            for hub in hubs:
                with hub.lock:
                    if hub.last_put > revision:
                        waiter.got(hub.key)
                    else:
                        hub.waiters.add(waiter)
            late = {hub.key for hub in hubs if hub.start_revision > revision + 1}
            if late & waiter.still():
                still = recheck()  # puts in (revision, start) are not the watches': read them
                for key in late - still:
                    waiter.got(key)
            if not waiter.still():
                waiter.done.set()
            waiter.done.wait(timeout)
            if waiter.still():
                return None
            values: dict[bytes, bytes] = {}
            for hub in hubs:
                with hub.lock:
                    if (value := hub._value_since(revision)) is not None:
                        values[hub.key] = value
            return values
        finally:
            for hub in hubs:
                with hub.lock:
                    hub.waiters.discard(waiter)
                hub._leave()

    @classmethod
    def _join(cls, client: EtcdClient, key: bytes, start: int) -> KeyWaits:
        with cls._registry_lock:
            hub = cls._live.get((id(client), key))
            if hub is None or hub.broken:
                hub = cls(client, key, start)
                cls._live[(id(client), key)] = hub
            hub.users += 1
            return hub

    def _value_since(self, revision: int) -> bytes | None:
        """(Under `lock`.) What `get` returns of the key, missing at `revision`, as far as the
        watch knows it for sure: it saw every put since (it started right after `revision`), and
        no part of the key was put since (a counter's value is its value plus its deltas: a fold
        puts a partial sum)."""
        if self.start_revision > revision + 1 or self.last_part > revision:
            return None
        return self.last_value

    def _leave(self) -> None:
        with KeyWaits._registry_lock:
            self.users -= 1
            if self.users > 0:
                return
            if KeyWaits._live.get((id(self.client), self.key)) is self:
                del KeyWaits._live[(id(self.client), self.key)]
        self._end()

    def _end(self) -> None:
        """Leave the stream and wake every waiter (those not satisfied retry)."""
        self._break()
        with self.lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.remove(self)

    def _break(self) -> None:
        """No new waiter joins this watch; its waiters wake (those not satisfied retry)."""
        with self.lock:
            self.broken = True
            for w in self.waiters:
                w.done.set()

    # -- watch_stream.Watcher (called on the stream's thread) --------------------------------

    def resume_revision(self) -> int | None:
        return self.start_revision

    def created(self, revision: int) -> None:
        pass

    def received(self, events: list[Any]) -> None:
        with self.lock:
            put = False
            for ev in events:
                if ev.type == 0:  # PUT (of a value or of an add's delta)
                    put = True
                    self.last_put = int(ev.kv.mod_revision)
                    if ev.kv.key == self.key:
                        self.last_value = bytes(ev.kv.value)
                    else:
                        self.last_part = int(ev.kv.mod_revision)
            if put:
                for w in self.waiters:
                    w.got(self.key)

    def compacted(self, revision: int) -> None:
        # Puts it had not received are gone: its waiters re-read and wait again, on a new watch.
        # (Called under the stream's lock: this watch leaves the stream when its last user does.)
        self.start_revision = revision
        self._break()

    def disconnected(self) -> None:
        self._end()  # etcd (this member) went away: waiters retry, on a new watch
