"""An agent whose lease expired while its node lived keeps its place (issue 56).

etcd stalled past the TTL (a slow WAL disk, a SIGSTOPped etcd) lets every lease expire at once;
the node itself is healthy. `keep_place` registers the same node incarnation again under a new
lease (`Membership.rejoin`, refused once a leader recorded it failed), writes again the keys that
went with the old lease (its relay's, its metrics address) and lets the leader's probe (which it
answers meanwhile, elastic/coordinator/probe.py) vouch for it. The election campaigns again on
a lease of its own (`campaign_again`, `LeaderElection.recampaign`). A slow WAL disk makes etcd
answer each write seconds late, past the client's retries: both are tried again while etcd does
not answer, for up to `REJOIN_WITHIN_S`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from elastic.coordinator.client import etcd_unreachable
from elastic.roles.node_relay import LEASE_GONE

if TYPE_CHECKING:
    from elastic.roles.agent import Agent

log = logging.getLogger("elastic.agent")

REJOIN_WITHIN_S = 30.0
"""How long an agent whose lease expired while it lived keeps trying to register again (and to
campaign again) while etcd does not answer; past it, the node is fenced as before."""

T = TypeVar("T")


def _through_stall(call: Callable[[], T], *, who: str, what: str) -> T:
    """`call()`, tried again while etcd does not answer, up to REJOIN_WITHIN_S; its last error after."""
    deadline = time.monotonic() + REJOIN_WITHIN_S
    while True:
        try:
            return call()
        except Exception as exc:
            if not etcd_unreachable(exc) or time.monotonic() > deadline:
                raise
            log.warning("%s: %s: etcd did not answer (%s); trying again", who, what, type(exc).__name__)
            time.sleep(0.5)


def campaign_again(agent: Agent) -> None:
    """The election's lease expired while this agent lived: campaign on a new one (on a thread
    of its own), through an etcd that answers late."""
    try:
        _through_stall(agent.election.recampaign, who=agent.who, what="campaigning again")
    except Exception:  # noqa: BLE001 - another agent leads; this one stays a follower
        log.exception("%s: could not campaign again", agent.who)


_KEEPING = threading.Lock()
"""One re-registration at a time (a new lease may expire while the last one is being replaced)."""


def keep_place(agent: Agent) -> bool:
    """`_keep_place`, one call at a time."""
    with _KEEPING:
        return _keep_place(agent)


def _keep_place(agent: Agent) -> bool:
    """Our lease expired while this node and its workers lived (etcd stalled past the TTL):
    register again under a new lease (`Membership.rejoin`), the keys that went with the old
    one written again on it. True: the node keeps its place. False: the job recorded this
    incarnation failed (a leader's probe found no answer), or etcd refused: fenced."""
    if agent.injections.hanging or agent.injections.partitioned:  # injected: fenced, as meant
        return False
    with agent.lock:
        procs = list(agent.procs.values())
        if agent.exit_code is not None or not procs or any(p.poll() is not None for p in procs):
            return False
    current = agent.membership.lease
    if current is not None and not current.lost.is_set():
        # an earlier call registered again meanwhile: this one was called by a lease that it replaced
        # (one that expired while that call waited on etcd), and the node's place is kept
        return True
    old = agent.membership.lease_id
    try:
        new = _through_stall(agent.membership.rejoin, who=agent.who, what="registering again")
    except Exception as exc:  # noqa: BLE001 - etcd still out of reach: fenced, as before
        log.warning("%s: could not register again: %s", agent.who, exc)
        return False
    if new is None or old is None:
        log.warning("%s (incarnation %d): recorded failed meanwhile; not registering again", agent.who,
                    agent.incarnation)
        return False
    relay, metrics = agent.relay, agent.metrics
    try:
        again = _through_stall(lambda: relay.relet(old, new), who=agent.who, what="rewriting its keys") if relay else 0
        if metrics is not None:
            _through_stall(lambda: metrics.relet(new), who=agent.who, what="publishing its metrics again")
    except Exception as exc:
        if LEASE_GONE not in str(exc):
            raise
        # etcd still stalls (a slow disk: leases keep expiring): the new lease's own expiry
        # calls this again, and the node registers once more
        log.warning("%s: lease %x expired too before its keys were written again", agent.who, new)
        return True
    log.warning("%s (incarnation %d): lease %x expired while the node lived; registered again under lease %x "
                "(%d keys written again)", agent.who, agent.incarnation, old, new, again)
    return True
