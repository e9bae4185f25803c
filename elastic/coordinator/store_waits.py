"""Blocking waits of `EtcdStore`: one etcd watch per (client, store prefix), shared by every wait.

A wait that found keys missing at revision R needs every put after R on the prefix. Opening a
watch stream per such wait costs a stream, a thread and a cancel each time: a 1024-rank
generation opened ~200 of them in a burst. Here the first waiter of a prefix opens one stream
(from its own R + 1) and later waiters join it while any waiter remains. The stream records the
revision of the last put of every key it saw, so a waiter that joins late is satisfied by a put it
already passed, provided that put came after the waiter's own read; a waiter whose read is older
than the stream's start re-reads once after joining (the caller's `recheck`), which covers the gap.

If the stream breaks (etcd restarting), its waiters are woken unsatisfied and retry with a new one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import grpc
from etcd3 import etcdrpc
from etcd3.utils import prefix_range_end

from .client import TRANSIENT_ERRORS, fail_over
from .etcd_api import EtcdClient


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
        self.client, self.prefix, self.start_revision, self.logical = client, prefix, start_revision, logical
        self.lock = threading.Lock()
        self.waiters: set[_Waiter] = set()
        self.last_put: dict[bytes, int] = {}
        self.broken = False
        self.users = 0
        self._stop = threading.Event()
        self._call: Any = None
        threading.Thread(target=self._run, name=f"store-watch {prefix}", daemon=True).start()

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
    ) -> bool:
        """Block until every key of `missing` (seen missing at `revision`) was put, or `timeout`
        seconds passed (False), or the stream broke (False: the caller retries)."""
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
                return True
            waiter.done.wait(timeout)
            with hub.lock:
                return not waiter.missing
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

    def _leave(self) -> None:
        with PrefixWaits._registry_lock:
            self.users -= 1
            if self.users > 0:
                return
            if PrefixWaits._live.get((id(self.client), self.prefix)) is self:
                del PrefixWaits._live[(id(self.client), self.prefix)]
        self._stop.set()
        with self.lock:
            if self._call is not None:
                self._call.cancel()

    def _requests(self) -> Iterator[Any]:
        create = etcdrpc.WatchCreateRequest(
            key=self.prefix.encode(),
            range_end=prefix_range_end(self.prefix.encode()),
            start_revision=self.start_revision,
        )
        yield etcdrpc.WatchRequest(create_request=create)
        self._stop.wait()

    def _run(self) -> None:
        try:
            call = etcdrpc.WatchStub(self.client.channel).Watch(
                self._requests(), credentials=self.client.call_credentials, metadata=self.client.metadata
            )
            with self.lock:
                self._call = call
                if self._stop.is_set():
                    call.cancel()
            for rs in call:
                if rs.canceled or rs.compact_revision:
                    break
                with self.lock:
                    for ev in rs.events:
                        if ev.type == 0:  # PUT (of a value or of an add's delta)
                            key = self.logical(ev.kv.key)
                            self.last_put[key] = int(ev.kv.mod_revision)
                            for w in self.waiters:
                                w.missing.discard(key)
                    for w in self.waiters:
                        if not w.missing:
                            w.done.set()
        except grpc.RpcError:
            if not self._stop.is_set():  # etcd (this member) went away: waiters retry elsewhere
                fail_over(self.client)
        except TRANSIENT_ERRORS:
            pass  # no member available right now (`channel` raised): waiters retry
        finally:
            with self.lock:
                self.broken = True
                for w in self.waiters:
                    w.done.set()
