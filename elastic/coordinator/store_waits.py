"""Blocking waits of `EtcdStore`: shared etcd watches of the missing keys, or of the whole prefix.

A wait that found keys missing at revision R needs the puts after R of those keys. Two ways to
watch them, each the cheaper one somewhere:

- **a watch a key**, of exactly its etcd range `[k, k\\1)` (its value, an `add`'s deltas, a queue's
  items): a put then reaches only the processes waiting on its key. A real job has a process and
  an etcd client a rank, each waiting on a few keys at a time: a watch of the whole prefix there
  sends every put to every process with a wait open (a 4,096-rank lazy gloo rendezvous with a
  client a rank: 1.2 million events, 286 a rank, for 4,096 puts; bench/README.md).
- **a watch of the whole store prefix**, once the client has `KEY_WATCHES_MAX` key watches open
  under it: a client serving many waiting ranks at once (the simulations of bench/rendezvous_scale.py
  hold thousands a client) would otherwise open and cancel a watch for each, and etcd, busy,
  answers such a stream's creates late (after its history was compacted, at 16,384 ranks), where
  one watch of the prefix, opened once, costs the client an event a put.

Either watch is shared by every wait of the process on it while any remains: the first waiter
opens it from its own R + 1, later ones join it. The watch records the revision of the last put
of every key it saw, so a waiter that joins late is satisfied by a put it already passed, provided
that put came after the waiter's own read; a waiter whose read is older than the watch's start
re-reads once after joining (the caller's `recheck`), which covers the gap. A satisfied waiter
gets the values of its keys' last puts, when the watch saw every put since the waiter's read and
none of them was a counter's delta or a queue's item: the store keeps them for the caller's next
`get`. The watches ride the client's one Watch stream (`watch_stream.py`) and their events are
handled on that stream's thread (a few set operations): no stream or thread of their own.

If the stream breaks (etcd restarting) or a watch's history was compacted, its waiters are woken
unsatisfied and retry with a new watch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .etcd_api import EtcdClient
from .watch_stream import WatchStream, subscribe

KEY_WATCHES_MAX = 16
"""Key watches a client keeps open under one store prefix; more waiting keys share a watch of the
prefix (module doc)."""
_KEY_END = b"\x01"
"""A store key `k`'s etcd keys are `[k, k\\1)` (store.py)."""

_registry_lock = threading.Lock()
_live: dict[tuple[int, bytes, bool], _Watch] = {}
"""The open watches: (id(client), the store key or prefix watched, whole prefix?) -> watch."""
_key_watches: dict[tuple[int, bytes], int] = {}
"""(id(client), store prefix) -> key watches open under it."""


class _Waiter:
    """One blocked wait: the keys it still misses, across the watches it joined."""

    def __init__(self, missing: set[bytes]) -> None:
        self.missing = missing
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


class _Watch:
    """One shared watch: of a store key, or of a whole store prefix (module doc)."""

    def __init__(
        self, client: EtcdClient, store_prefix: bytes, watched: bytes, whole: bool, start_revision: int,
        logical: Callable[[bytes], bytes],
    ) -> None:
        self.client, self.store_prefix, self.whole = client, store_prefix, whole
        self.start_revision, self.logical = start_revision, logical
        self.lock = threading.Lock()
        self.waiting: dict[bytes, set[_Waiter]] = {}
        """The waiters of each key not yet put."""
        self.last_put: dict[bytes, int] = {}
        """The revision of each key's last put seen (of its value or of a part)."""
        self.last_value: dict[bytes, bytes] = {}
        """The value of each key's last put of the key itself seen."""
        self.last_part: dict[bytes, int] = {}
        """The revision of each key's last put of a part seen (a counter's delta, a queue's item)."""
        self.broken = False
        self.users = 0
        # What the client's Watch stream asks of a watch (watch_stream.Watcher); `prefix` is also
        # what this watch is registered under in `_live`:
        self.prefix = watched
        self.range_end = None if whole else watched + _KEY_END
        self.prev_kv = False
        self.retry_pause = 0.1
        self._stream: WatchStream | None = subscribe(client, self)

    def _add(self, waiter: _Waiter, keys: set[bytes], revision: int) -> None:
        """(Under `lock`.) `waiter` waits here for `keys`, missing at `revision`."""
        for key in keys:
            if self.last_put.get(key, 0) > revision:
                waiter.got(key)
            else:
                self.waiting.setdefault(key, set()).add(waiter)

    def _drop(self, waiter: _Waiter, keys: set[bytes]) -> None:
        """(Under `lock`.)"""
        for key in keys:
            if (waiters := self.waiting.get(key)) is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self.waiting[key]

    def _value_since(self, key: bytes, revision: int) -> bytes | None:
        """(Under `lock`.) What `get` returns of `key`, missing at `revision`, as far as the watch
        knows it for sure: it saw every put since (it started right after `revision`), and no part
        of the key was put since (a counter's value is its value plus its deltas: a fold puts a
        partial sum)."""
        if self.start_revision > revision + 1 or self.last_part.get(key, 0) > revision:
            return None
        return self.last_value.get(key)

    def _leave(self) -> None:
        with _registry_lock:
            self.users -= 1
            if self.users > 0:
                return
            _forget(self)
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
            for waiters in self.waiting.values():
                for w in waiters:
                    w.done.set()

    # -- watch_stream.Watcher (called on the stream's thread) --------------------------------

    def resume_revision(self) -> int | None:
        return self.start_revision

    def created(self, revision: int) -> None:
        pass

    def received(self, events: list[Any]) -> None:
        with self.lock:
            put: set[bytes] = set()
            for ev in events:
                if ev.type == 0:  # PUT (of a value or of an add's delta)
                    key = self.logical(ev.kv.key)
                    put.add(key)
                    self.last_put[key] = int(ev.kv.mod_revision)
                    if ev.kv.key == key:
                        self.last_value[key] = bytes(ev.kv.value)
                    else:
                        self.last_part[key] = int(ev.kv.mod_revision)
            for key in put:
                for w in self.waiting.pop(key, ()):
                    w.got(key)

    def compacted(self, revision: int) -> None:
        # Puts it had not received are gone: its waiters re-read and wait again, on a new watch.
        # (Called under the stream's lock: this watch leaves the stream when its last user does.)
        self.start_revision = revision
        self._break()

    def disconnected(self) -> None:
        self._end()  # etcd (this member) went away: waiters retry, on a new watch


def _forget(watch: _Watch) -> None:
    """(Under `_registry_lock`.) `watch` takes no new waiter."""
    entry = (id(watch.client), watch.prefix, watch.whole)
    if _live.get(entry) is watch:
        del _live[entry]
        if not watch.whole:
            count = (id(watch.client), watch.store_prefix)
            _key_watches[count] -= 1
            if not _key_watches[count]:
                del _key_watches[count]


def _join(
    client: EtcdClient, prefix: bytes, missing: set[bytes], start: int, logical: Callable[[bytes], bytes]
) -> list[tuple[_Watch, set[bytes]]]:
    """The watches that cover `missing` (with the keys each covers), joined or opened from `start`."""

    def joined(watched: bytes, whole: bool) -> _Watch:
        watch = _live.get((id(client), watched, whole))
        if watch is None or watch.broken:
            if watch is not None:
                _forget(watch)
            watch = _live[(id(client), watched, whole)] = _Watch(client, prefix, watched, whole, start, logical)
            if not whole:
                _key_watches[(id(client), prefix)] = _key_watches.get((id(client), prefix), 0) + 1
        watch.users += 1
        return watch

    with _registry_lock:
        whole = _live.get((id(client), prefix, True))
        new_keys = [k for k in missing if (id(client), k, False) not in _live]
        if (whole is None or whole.broken) and (
            _key_watches.get((id(client), prefix), 0) + len(new_keys) <= KEY_WATCHES_MAX
        ):
            return [(joined(k, False), {k}) for k in sorted(missing)]
        return [(joined(prefix, True), set(missing))]


def wait_for(
    client: EtcdClient,
    prefix: str,
    missing: set[bytes],
    revision: int,
    timeout: float,
    *,
    logical: Callable[[bytes], bytes],
    recheck: Callable[[], set[bytes]],
) -> dict[bytes, bytes] | None:
    """Block until every key of `missing` (etcd keys under the store prefix `prefix`, seen missing at
    `revision`) was put: then the values of the last puts the watches saw of them (those that put
    the key itself, not a counter's delta), for the caller's next `get`. None when `timeout`
    seconds passed first, or a watch broke (the caller retries). `logical` maps an etcd key to
    the store key it belongs to (a counter's delta to its counter)."""
    watches = _join(client, prefix.encode(), missing, revision + 1, logical)
    waiter = _Waiter(set(missing))
    try:
        for watch, keys in watches:
            with watch.lock:
                watch._add(waiter, keys, revision)
        late = {k for watch, keys in watches if watch.start_revision > revision + 1 for k in keys}
        if late & waiter.still():
            still = recheck()  # puts in (revision, start) are not the watches': read them
            for key in late - still:
                waiter.got(key)
        if waiter.still():
            waiter.done.wait(timeout)
        if waiter.still():
            return None
        values: dict[bytes, bytes] = {}
        for watch, keys in watches:
            with watch.lock:
                for key in keys:
                    if (value := watch._value_since(key, revision)) is not None:
                        values[key] = value
        return values
    finally:
        for watch, keys in watches:
            with watch.lock:
                watch._drop(waiter, keys)
            watch._leave()
