"""Blocking waits of `EtcdStore`: one etcd watch per (client, store prefix), shared by every wait.

A wait that found keys missing at revision R needs every put after R on the prefix. Opening a
watch per such wait costs a create and a cancel each time: a 1024-rank generation opened ~200 of
them in a burst. Here the first waiter of a prefix opens one watch (from its own R + 1) and later
waiters join it while any waiter remains. The watch records the revision of the last put of every
key it saw, so a waiter that joins late is satisfied by a put it already passed, provided that put
came after the waiter's own read; a waiter whose read is older than the watch's start re-reads
once after joining (the caller's `recheck`), which covers the gap. A satisfied waiter gets the values of its
keys' last puts, when the watch saw every put since its read and none of them was a counter's
delta or a queue's item: the store keeps them for the caller's next `get`. The watch rides the client's
one Watch stream (`watch_stream.py`) and its events are handled on that stream's thread (a few
set operations): no stream or thread of its own.

If the stream breaks (etcd restarting) or the watch's history was compacted, its waiters are
woken unsatisfied and retry with a new watch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, ClassVar

from .etcd_api import EtcdClient
from .watch_stream import WatchStream, subscribe


class _Waiter:
    def __init__(self, missing: set[bytes], after: int) -> None:
        self.missing = missing
        self.after = after
        self.done = threading.Event()


class PrefixWaits:
    """The shared watch of one store prefix (module doc); `wait_for` is the whole interface."""

    _live: ClassVar[dict[tuple[int, str], PrefixWaits]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self, client: EtcdClient, prefix: str, start_revision: int, logical: Callable[[bytes], bytes]
    ) -> None:
        self.client, self.store_prefix, self.start_revision, self.logical = client, prefix, start_revision, logical
        self.lock = threading.Lock()
        self.waiters: set[_Waiter] = set()
        self.last_put: dict[bytes, int] = {}
        self.last_value: dict[bytes, bytes] = {}
        """The value of each key's last put of the key itself seen."""
        self.last_part: dict[bytes, int] = {}
        """The revision of each key's last put of a part seen (a counter's delta, a queue's item)."""
        self.broken = False
        self.users = 0
        # What the client's Watch stream asks of a watch (watch_stream.Watcher):
        self.prefix = prefix.encode()
        self.prev_kv = False
        self.retry_pause = 0.1
        self._stream: WatchStream | None = subscribe(client, self)

    @classmethod
    def wait_for(
        cls,
        client: EtcdClient,
        prefix: str,
        missing: set[bytes],
        revision: int,
        timeout: float,
        *,
        logical: Callable[[bytes], bytes],
        recheck: Callable[[], set[bytes]],
    ) -> dict[bytes, bytes] | None:
        """Block until every key of `missing` (seen missing at `revision`) was put: then the values
        of the last puts the watch saw of them (those that put the key itself, not a counter's
        delta), for the caller's next `get`. None when `timeout` seconds passed first, or the
        stream broke (the caller retries)."""
        hub = cls._join(client, prefix, revision + 1, logical)
        waiter = _Waiter(set(missing), revision)
        try:
            with hub.lock:
                waiter.missing = {k for k in waiter.missing if hub.last_put.get(k, 0) <= revision}
                if waiter.missing:
                    hub.waiters.add(waiter)
            if waiter.missing and hub.start_revision > revision + 1:
                still = recheck()  # puts in (revision, start) are not the stream's: read them
                with hub.lock:
                    waiter.missing &= still
            if not waiter.missing:
                with hub.lock:
                    return hub._values(missing, revision)
            waiter.done.wait(timeout)
            with hub.lock:
                return None if waiter.missing else hub._values(missing, revision)
        finally:
            with hub.lock:
                hub.waiters.discard(waiter)
            hub._leave()

    @classmethod
    def _join(
        cls, client: EtcdClient, prefix: str, start: int, logical: Callable[[bytes], bytes]
    ) -> PrefixWaits:
        with cls._registry_lock:
            hub = cls._live.get((id(client), prefix))
            if hub is None or hub.broken:
                hub = cls(client, prefix, start, logical)
                cls._live[(id(client), prefix)] = hub
            hub.users += 1
            return hub

    def _values(self, keys: set[bytes], revision: int) -> dict[bytes, bytes]:
        """(Under `lock`.) What `get` returns of `keys`, missing at `revision`, as far as the watch
        knows it for sure: it saw every put since (it started right after `revision`), and no part
        of the key was put since (a counter's value is its value plus its deltas: a fold puts a
        partial sum)."""
        if self.start_revision > revision + 1:
            return {}
        return {k: v for k in keys
                if (v := self.last_value.get(k)) is not None and self.last_part.get(k, 0) <= revision}

    def _leave(self) -> None:
        with PrefixWaits._registry_lock:
            self.users -= 1
            if self.users > 0:
                return
            if PrefixWaits._live.get((id(self.client), self.store_prefix)) is self:
                del PrefixWaits._live[(id(self.client), self.store_prefix)]
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
            for ev in events:
                if ev.type == 0:  # PUT (of a value or of an add's delta)
                    key = self.logical(ev.kv.key)
                    self.last_put[key] = int(ev.kv.mod_revision)
                    if ev.kv.key == key:
                        self.last_value[key] = bytes(ev.kv.value)
                    else:
                        self.last_part[key] = int(ev.kv.mod_revision)
                    for w in self.waiters:
                        w.missing.discard(key)
            for w in self.waiters:
                if not w.missing:
                    w.done.set()

    def compacted(self, revision: int) -> None:
        # Puts it had not received are gone: its waiters re-read and wait again, on a new watch.
        # (Called under the stream's lock: this watch leaves the stream when its last user does.)
        self.start_revision = revision
        self._break()

    def disconnected(self) -> None:
        self._end()  # etcd (this member) went away: waiters retry, on a new watch
