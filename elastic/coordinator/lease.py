"""A lease kept alive by a background thread, shared by membership and leader election."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .client import TRANSIENT_ERRORS
from .etcd_api import EtcdClient
from .lease_stream import kept_stream

log = logging.getLogger(__name__)


class KeptLease:
    """Grant a lease of `ttl` seconds and refresh it every `interval` until revoked or lost.

    Refreshes ride the client's one LeaseKeepAlive stream (`lease_stream.py`), shared with the
    client's other kept leases. While etcd is unreachable the refresh is retried every 0.1 s; etcd extends all leases when
    it comes back, so an outage shorter than the TTL costs nobody their lease. If a refresh
    finds the lease already expired (this process was hung longer than the TTL), `lost` is set
    and `on_lost` runs once: whatever hung on the lease was deleted and peers saw it go. With
    `give_up_s`, an outage longer than that is treated the same way (`lost_reason` says which):
    a process whose etcd is gone for good stops waiting for it.
    """

    def __init__(self, client: EtcdClient, ttl: int, *, interval: float | None = None,
                 on_lost: Callable[[], None] | None = None, name: str = "lease",
                 lease_id: int | None = None, give_up_s: float | None = None) -> None:
        if ttl < 2:
            raise ValueError(f"lease ttl must be >= 2 s, got {ttl}")
        if give_up_s is not None and give_up_s <= 0:
            raise ValueError(f"give_up_s must be > 0 (or None: never), got {give_up_s}")
        self.client = client
        self.ttl = ttl
        self.interval = interval if interval is not None else ttl / 4
        self.give_up_s = give_up_s
        self.lost = threading.Event()
        self.lost_reason = ""
        self._on_lost = on_lost
        self.name = name
        self._stop = threading.Event()
        # lease_id: keep an existing lease alive (one another process granted) instead of a new one.
        self.id: int = lease_id if lease_id is not None else client.lease(ttl).id
        self._stream = kept_stream(client)
        self._thread = threading.Thread(target=self._run, name=f"{name}-keepalive", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._keep()
        finally:
            self._stream.release()

    def _keep(self) -> None:
        interval = self.interval
        down_since: float | None = None
        while not self._stop.wait(interval):
            try:
                ttl = self._stream.refresh(self.id)
            except TRANSIENT_ERRORS:
                interval = 0.1
                now = time.monotonic()
                down_since = now if down_since is None else down_since
                if self.give_up_s is not None and now - down_since > self.give_up_s:
                    self._give_up(f"etcd unreachable for {now - down_since:.0f} s")
                    return
                continue
            interval, down_since = self.interval, None
            if ttl <= 0:
                self._give_up("lease expired")
                return

    def _give_up(self, reason: str) -> None:
        if self._stop.is_set():  # stopped while a refresh was in flight: no one holds this lease any more
            return
        log.warning("lease %x (%s) lost: %s", self.id, self.name, reason)
        self.lost_reason = reason
        self.lost.set()
        if self._on_lost is not None:
            self._on_lost()

    def stop_refreshing(self) -> None:
        """Stop the refresh thread; the lease then expires after its TTL."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

    def revoke(self) -> None:
        """Stop refreshing and revoke now: every key on the lease is deleted at once."""
        self._stop.set()
        try:
            self.client.revoke_lease(self.id)
        except TRANSIENT_ERRORS:
            log.warning("could not revoke lease %x; it will expire", self.id)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)
