"""Leader election: the first candidate to create `leader` on its lease wins.

Every candidate runs `LeaderElection`: a transaction puts `leader = <candidate id>` only if the
key does not exist, attached to the candidate's lease. The others watch the key; when the
leader's lease is revoked or expires (the leader died or hung), the key vanishes and the next
campaign round elects someone else, so a new leader is in place within the TTL plus etcd's
expiry sweep. Writers that act as leader fence their writes with `leader_compare()`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .client import TRANSIENT_ERRORS
from .etcd_api import Compare, EtcdClient
from .keys import JobKeys, check_name
from .lease import KeptLease
from .watch import PrefixWatch, WatchEvent

log = logging.getLogger(__name__)


def current_leader(client: EtcdClient, keys: JobKeys) -> str | None:
    """Id of the current leader, or None while there is none."""
    value, _ = client.get(keys.leader)
    return value.decode() if value is not None else None


_RECHECK_S = 5.0
"""A standby candidate re-reads the leader key this often without a watch event (the watch
wakes it at once on every change; this costs etcd 2 requests per standby node per period)."""


class LeaderElection:
    """Campaign for leadership of one job until `resign()`; `on_change(leader_id)` on every change."""

    def __init__(self, client: EtcdClient, keys: JobKeys, candidate_id: str, *, ttl: int = 5,
                 on_change: Callable[[str | None], None] | None = None,
                 on_lost: Callable[[], None] | None = None) -> None:
        self.client = client
        self.keys = keys
        self.candidate_id = check_name("candidate id", candidate_id)
        self.ttl = ttl
        self._on_change = on_change
        self._on_lost = on_lost
        """Runs (on the lease's thread) when the campaign's lease expired while this process lived."""
        self._is_leader = threading.Event()
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._lease: KeptLease | None = None
        self._watch: PrefixWatch | None = None
        self._thread: threading.Thread | None = None
        self._resigned = False

    def start(self) -> LeaderElection:
        self._lease = KeptLease(self.client, self.ttl, on_lost=self._lease_lost, name="leader")
        self._watch = PrefixWatch(self.client, self.keys.leader, self._on_events)
        self._watch.wait_ready(5.0)
        self._thread = threading.Thread(target=self._campaign, name="election", daemon=True)
        self._thread.start()
        return self

    @property
    def started(self) -> bool:
        return self._thread is not None

    def is_leader(self) -> bool:
        return self._is_leader.is_set()

    def wait_leader(self, timeout: float) -> bool:
        """Block until this candidate is the leader; False on timeout."""
        return self._is_leader.wait(timeout)

    def leader(self) -> str | None:
        return current_leader(self.client, self.keys)

    def leader_compare(self) -> Compare:
        """A transaction compare that holds only while this candidate is the leader."""
        return self.client.transactions.value(self.keys.leader) == self.candidate_id

    def resign(self) -> None:
        """Give up leadership (the key goes with the lease) and stop campaigning."""
        self._resigned = True
        self._stop.set()
        self._changed.set()
        if self._watch is not None:
            self._watch.cancel()
        if self._lease is not None:
            self._lease.revoke()
        self._is_leader.clear()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _on_events(self, events: list[WatchEvent]) -> None:
        for ev in events:
            if ev.key != self.keys.leader:
                continue
            if ev.kind == "delete" and self._is_leader.is_set():
                self._is_leader.clear()
            if self._on_change is not None:
                self._on_change(ev.value.decode() if ev.kind == "put" else None)
        self._changed.set()

    def _lease_lost(self) -> None:
        self._is_leader.clear()
        self._stop.set()
        self._changed.set()
        if self._on_lost is not None:
            self._on_lost()

    def recampaign(self) -> bool:
        """Campaign again on a fresh lease after the last one expired while this candidate lived
        (etcd stalled past the TTL: every lease expired at once). False: the lease was not lost,
        or the candidate resigned."""
        lease = self._lease
        if lease is None or not lease.lost.is_set() or self._resigned:
            return False
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._stop.clear()
        self._lease = KeptLease(self.client, self.ttl, on_lost=self._lease_lost, name="leader")
        self._thread = threading.Thread(target=self._campaign, name="election", daemon=True)
        self._thread.start()
        log.warning("%s: campaigning again on a new lease (the last one expired)", self.candidate_id)
        return True

    def _campaign(self) -> None:
        assert self._lease is not None
        txn = self.client.transactions
        while not self._stop.is_set():
            self._changed.clear()
            try:
                won, _ = self.client.transaction(
                    compare=[txn.create(self.keys.leader) == 0],
                    success=[txn.put(self.keys.leader, self.candidate_id, lease=self._lease.id)],
                    failure=[],
                )
                if not won:
                    won = self.leader() == self.candidate_id
            except TRANSIENT_ERRORS:
                self._changed.wait(0.1)
                continue
            if won and not self._is_leader.is_set():
                log.info("%s is now the leader of %s", self.candidate_id, self.keys.job)
                self._is_leader.set()
            # Re-check on every change of the key, and now and then in case a watch event was missed.
            self._changed.wait(_RECHECK_S)
