"""Membership: who is in the job, kept alive by leases, with joins and losses delivered by watch.

A node registers `members/<node_id>` = its `NodeIdentity` (node id, incarnation, address,
devices) attached to a lease of `ttl` seconds that a background thread keeps alive. The key
disappears, and every watcher sees a loss, when

- the node reports a failure (`report_failure` revokes the lease at once: the fast path that
  the worker monitor takes when a local worker dies), or
- the node stops refreshing (hung, SIGSTOPped, partitioned, killed): etcd expires the lease
  within `ttl` (plus etcd's expiry sweep, ~0.5 s).

A worker that sees a collective error only *suspects* a peer: `confirm_loss` records the
suspicion and answers from etcd (lease gone: confirmed; still alive after the grace period:
not confirmed), so nobody acts on a rumour.

    m = Membership(client, JobKeys("job"), NodeIdentity(node_id="n0", incarnation=0,
                   address="10.0.0.1:5000", devices=8), config=MembershipConfig(ttl=5))
    m.join()
    watch = m.watch(lambda ev: print(ev.kind, ev.identity.node_id))
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from .client import etcd_unreachable
from .etcd_api import EtcdClient
from .events import record_event
from .jsonrecord import JsonRecord
from .keys import JobKeys, check_name
from .lease import KeptLease
from .watch import PrefixWatch, WatchEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class NodeIdentity(JsonRecord):
    """Who a member is; a restarted node comes back with a higher incarnation."""

    node_id: str
    """Stable name of the node (one host, or one local torchrun instance)."""
    incarnation: int
    """Counts the node's (re)starts; a member is (node_id, incarnation)."""
    address: str
    """`host:port` where the node serves peers (shard transfer)."""
    devices: int
    """Number of devices (= workers) on the node."""

    def __post_init__(self) -> None:
        check_name("node id", self.node_id)
        if self.incarnation < 0:
            raise ValueError(f"incarnation must be >= 0, got {self.incarnation}")
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices}")


@dataclass(frozen=True, kw_only=True)
class MembershipConfig:
    """Lease settings of a member."""

    ttl: int = 5
    """Lease time-to-live in seconds: a silent node is declared lost after about this long."""
    keepalive_interval: float | None = None
    """Seconds between lease refreshes; None means ttl / 4."""
    give_up_s: float | None = None
    """Seconds etcd may stay unreachable before this member counts itself lost; None: never."""

    def __post_init__(self) -> None:
        if self.ttl < 2:
            raise ValueError(f"lease ttl must be >= 2 s (etcd's minimum), got {self.ttl}")
        if self.keepalive_interval is not None and not 0 < self.keepalive_interval < self.ttl:
            raise ValueError(f"keepalive_interval must be in (0, ttl), got {self.keepalive_interval}")
        if self.give_up_s is not None and self.give_up_s <= 0:
            raise ValueError(f"give_up_s must be > 0 (or None: never), got {self.give_up_s}")

    @property
    def interval(self) -> float:
        return self.keepalive_interval if self.keepalive_interval is not None else self.ttl / 4


@dataclass(frozen=True, kw_only=True)
class MemberEvent:
    """A join or a loss, as seen through the watch."""

    kind: Literal["join", "loss"]
    """Whether the member appeared or disappeared."""
    identity: NodeIdentity
    """The member that joined or was lost."""
    revision: int
    """etcd revision of the change."""
    observed_at: float
    """time.monotonic() when this process received it (comparable across processes on Linux)."""


class Membership:
    """This node's registration, plus read/watch/report access to everyone's."""

    def __init__(
        self,
        client: EtcdClient,
        keys: JobKeys,
        identity: NodeIdentity,
        *,
        config: MembershipConfig | None = None,
        on_self_lost: Callable[[], None] | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.identity = identity
        self.config = config or MembershipConfig()
        self._on_self_lost = on_self_lost
        self.lease: KeptLease | None = None
        self.lost = threading.Event()

    # -- this node -------------------------------------------------------------------------

    def join(self) -> None:
        """Grant a lease, publish our identity on it, start refreshing it."""
        if self.lease is not None:
            raise RuntimeError("already joined")
        lease = KeptLease(self.client, self.config.ttl, interval=self.config.interval, on_lost=self._lost,
                          name=f"member-{self.identity.node_id}", give_up_s=self.config.give_up_s)
        key = self.keys.member(self.identity.node_id)
        ok, _ = self.client.transaction(
            compare=[self.client.transactions.create(key) == 0],
            success=[self.client.transactions.put(key, self.identity.to_json(), lease=lease.id)],
            failure=[],
        )
        if not ok:
            value, _meta = self.client.get(key)
            if value is not None and NodeIdentity.from_json(value).incarnation >= self.identity.incarnation:
                lease.revoke()
                raise ValueError(
                    f"node {self.identity.node_id!r} is already a member with incarnation "
                    f"{NodeIdentity.from_json(value).incarnation}; a rejoin needs a higher incarnation"
                )
            # An older incarnation of this node: replace it (watchers see its loss and our join).
            self.client.put(key, self.identity.to_json(), lease=lease.id)
        self.lease = lease
        record_event(self.client, self.keys, who=self.identity.node_id, kind="join",
                     incarnation=self.identity.incarnation)

    def adopt(self) -> None:
        """Take over the registration another process of this node made (torchrun's rendezvous
        handler registers (node_id, incarnation) before it starts the node agent): keep its
        lease alive from here too, so that the agent's lease id, failure reports and fencing
        work as after `join`. ValueError if that registration is not there."""
        if self.lease is not None:
            raise RuntimeError("already joined")
        value, meta = self.client.get(self.keys.member(self.identity.node_id))
        if value is None or meta is None or (
            NodeIdentity.from_json(value).incarnation != self.identity.incarnation
        ):
            raise ValueError(
                f"node {self.identity.node_id!r} incarnation {self.identity.incarnation} is not registered "
                "(no rendezvous registration to adopt)"
            )
        self.lease = KeptLease(self.client, self.config.ttl, interval=self.config.interval, on_lost=self._lost,
                               name=f"member-{self.identity.node_id}", lease_id=meta.lease_id,
                               give_up_s=self.config.give_up_s)

    def rejoin(self) -> int | None:
        """After our lease expired while this node lived (etcd stalled past the TTL): register
        the same identity under a new lease, unless someone recorded this incarnation failed
        (`failed/<node>/<inc>`: a leader's probe found it dead and the job moved on) or the key
        is another's. Returns the new lease id, or None: the node stays fenced. One transaction,
        so a leader that records the failure after it revokes the new lease (`report_failure`)."""
        old = self.lease
        lease = KeptLease(self.client, self.config.ttl, interval=self.config.interval, on_lost=self._lost,
                          name=f"member-{self.identity.node_id}", give_up_s=self.config.give_up_s)
        key = self.keys.member(self.identity.node_id)
        failed = self.keys.failure(self.identity.node_id, self.identity.incarnation)
        txn = self.client.transactions
        try:
            ok, _ = self.client.transaction(
                compare=[txn.create(key) == 0, txn.version(failed) == 0],
                success=[txn.put(key, self.identity.to_json(), lease=lease.id)],
                failure=[],
            )
        except Exception:
            lease.stop_refreshing()  # a try that etcd did not answer leaves no kept lease behind
            raise
        if not ok:
            lease.revoke()
            return None
        self.lease = lease
        self.lost.clear()
        try:  # registered: an event that etcd does not take (it stalls again) must not make the caller try again
            record_event(self.client, self.keys, who=self.identity.node_id, kind="rejoined",
                         incarnation=self.identity.incarnation, old_lease=old.id if old is not None else None,
                         lease=lease.id)
        except Exception as exc:
            if not etcd_unreachable(exc):
                raise
            log.warning("%s: registered again under lease %x; the event was not written: etcd did not answer (%s)",
                        self.identity.node_id, lease.id, type(exc).__name__)
        return lease.id

    @property
    def lost_reason(self) -> str:
        """Why this member counts itself lost ("lease expired", "etcd unreachable for N s"), or ""."""
        return self.lease.lost_reason if self.lease is not None else ""

    def _lost(self) -> None:
        if self.lease is not None and not self.lease.lost.is_set():
            return  # a replaced lease (an earlier registration, a try etcd answered late) ended: not ours
        log.warning("%s: this node is lost (%s)", self.identity.node_id, self.lost_reason)
        self.lost.set()
        if self._on_self_lost is not None:
            self._on_self_lost()

    @property
    def lease_id(self) -> int | None:
        return self.lease.id if self.lease is not None else None

    def leave(self) -> None:
        """Deregister (revokes the lease: peers see a loss at once)."""
        if self.lease is not None:
            self.lease.revoke()

    def report_failure(self, node_id: str | None = None, incarnation: int | None = None, *,
                       reason: str) -> bool:
        """Declare a member failed now: mark it in `failed/` and revoke its lease.

        Defaults to this node (the worker monitor's path). Returns False when that member (that
        incarnation) is no longer registered, i.e. someone else already reported it.
        """
        node_id = node_id if node_id is not None else self.identity.node_id
        if node_id == self.identity.node_id and incarnation is None:
            incarnation = self.identity.incarnation
        key = self.keys.member(node_id)
        value, meta = self.client.get(key)
        if value is None or meta is None:
            return False
        ident = NodeIdentity.from_json(value)
        if incarnation is not None and ident.incarnation != incarnation:
            return False
        if node_id == self.identity.node_id and self.lease is not None:
            self.lease.stop_refreshing()
        # the report before the revoke: a leader that sees the key go already finds why (and
        # does not take the node for a suspect to probe, roles/leader_suspects.py)
        self.client.put(
            self.keys.failure(node_id, ident.incarnation),
            json.dumps({"reporter": self.identity.node_id, "reason": reason, "time": time.time()}),
        )
        self.client.revoke_lease(meta.lease_id)
        record_event(self.client, self.keys, who=self.identity.node_id, kind="failure",
                     node=node_id, incarnation=ident.incarnation, reason=reason)
        return True

    # -- everyone --------------------------------------------------------------------------

    def members(self) -> dict[str, NodeIdentity]:
        """Live members by node id."""
        return read_members(self.client, self.keys)[0]

    def watch(self, on_event: Callable[[MemberEvent], None], *, start_revision: int | None = None,
              on_connection: Callable[[bool], None] | None = None) -> PrefixWatch:
        """Deliver every join and loss after `start_revision` (default: from now) to `on_event`."""
        return watch_members(self.client, self.keys, on_event, start_revision=start_revision,
                             on_connection=on_connection)

    def confirm_loss(self, node_id: str, incarnation: int, *, reason: str,
                     timeout: float | None = None) -> bool:
        """Turn a suspicion (a collective error) into a fact, through etcd.

        Records the suspicion, then waits up to `timeout` (default ttl + 1 s, long enough for a
        hung peer's lease to expire) for etcd to show the member gone. True: the loss is
        confirmed and the caller may act; False: the peer is alive as far as etcd knows.
        """
        check_name("node id", node_id)
        self.client.put(
            self.keys.suspect(node_id, incarnation, self.identity.node_id),
            json.dumps({"reason": reason, "time": time.time()}),
        )
        deadline = time.monotonic() + (timeout if timeout is not None else self.config.ttl + 1.0)
        while True:
            value, _ = self.client.get(self.keys.member(node_id))
            if value is None or NodeIdentity.from_json(value).incarnation != incarnation:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def read_members(client: EtcdClient, keys: JobKeys) -> tuple[dict[str, NodeIdentity], int]:
    """Live members by node id, and the etcd revision they were read at."""
    resp = client.get_prefix_response(keys.members)
    members = {}
    for kv in resp.kvs:
        ident = NodeIdentity.from_json(kv.value)
        members[ident.node_id] = ident
    return members, int(resp.header.revision)


def watch_members(client: EtcdClient, keys: JobKeys, on_event: Callable[[MemberEvent], None], *,
                  start_revision: int | None = None,
                  on_connection: Callable[[bool], None] | None = None) -> PrefixWatch:
    """Watch `members/` and translate key changes into joins and losses."""

    def handle(events: list[WatchEvent]) -> None:
        now = time.monotonic()
        for ev in events:
            if ev.prev_value:
                old = NodeIdentity.from_json(ev.prev_value)
                if ev.kind == "delete" or NodeIdentity.from_json(ev.value) != old:
                    on_event(MemberEvent(kind="loss", identity=old, revision=ev.revision, observed_at=now))
            if ev.kind == "put" and (not ev.prev_value or ev.prev_value != ev.value):
                new = NodeIdentity.from_json(ev.value)
                on_event(MemberEvent(kind="join", identity=new, revision=ev.revision, observed_at=now))

    return PrefixWatch(client, keys.members, handle, start_revision=start_revision,
                       on_connection=on_connection, prev_kv=True)
