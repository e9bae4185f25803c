"""Two witnesses before the leader removes a node (issue 56; DESIGN.md invariant 8).

A lease expiry is one witness that a node died, and etcd can be the one at fault: a slow WAL
fdatasync or a SIGSTOPped etcd lets every lease of the job expire at once, healthy nodes too.
So the leader's round reads the members through `SuspectGuard.members` instead of as they stand:

- a node of the generation whose member key is gone *with* a failure report of its own
  (`failed/<node>/<inc>`: its monitor saw a worker die, the fast path) is lost at once, also
  when the report lands while the node is being probed (the monitor now writes it before it
  revokes the lease, so that is rare);
- a node whose key went *without* one (its lease expired) is a *suspect*: the guard probes its
  agent directly (elastic/coordinator/probe.py, deadline `PROBE_DEADLINE_S`). A suspect that
  answers alive keeps its place, as if its key were there (its agent registers again under a new
  lease, Membership.rejoin); one that does not answer is recorded failed (`failed/<node>/<inc>`,
  which also refuses its re-registration; written under the leader's fence, as after an etcd
  stall two agents may each lead for a round: `NoLongerLeader` ends the round) and lost as before.
- A suspect that answers but has not registered again `rejoin_s` (default: two TTLs, so that a starved machine's late re-registration is no loss) after it
  turned suspect, after the leader's own etcd requests last stalled, and after the leader took
  office, is lost too: it lives
  but cannot reach etcd (a one-way partition), and a node cut off from the control plane cannot
  follow a generation change. A live agent registers again within a keep-alive period of etcd
  answering (roles/agent_rejoin.py), so the grace costs a node with a healthy path nothing.
- *Mass suspicion*: more than half the generation's nodes, or more than f + 1, suspect within
  `window_s`, or the leader's own etcd requests stalled in that window (a read slower than
  `STALL_S`, or a gap between its rounds longer than the TTL). The guard then freezes re-planning
  around anything but the nodes that fail the probe: it probes each silent one twice before it
  gives up on it, and when every suspect answered it records a control-plane stall and changes
  nothing.

Every verdict that changes goes into the `suspicion` key (elastic/records/suspicion.py) and a
`suspects` event: the suspects, the answers, whether it was mass suspicion or a stall, the
decision. A real hang (the agent SIGSTOPped too) is found within the TTL plus the probe's
deadline; a SIGKILLed node's probe is refused at once.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.events import record_event
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.coordinator.membership import NodeIdentity, read_members
from elastic.coordinator.probe import PROBE_DEADLINE_S, ProbeAnswer, probe
from elastic.records.generation import GenerationRecord
from elastic.records.suspicion import KEPT, LOST, STALL, SuspicionRecord
from elastic.records.workers import node_id, node_of

log = logging.getLogger(__name__)

STALL_S = 1.0
"""A read of the members slower than this means the leader's own etcd requests stalled."""

Prober = Callable[[str, float], ProbeAnswer | None]
"""(address, deadline in seconds) -> the answer, or None (the probe's signature)."""


class NoLongerLeader(RuntimeError):
    """A failure record was not written: this agent is no longer the leader (its round ends)."""


def _probe(address: str, deadline_s: float) -> ProbeAnswer | None:
    return probe(address, deadline_s=deadline_s)


class SuspectGuard:
    """The leader's view of the members, suspects vouched for by their probe (module doc)."""

    def __init__(self, client: EtcdClient, keys: JobKeys, *, who: str, fault_tolerance: int, ttl: float,
                 deadline_s: float = PROBE_DEADLINE_S, window_s: float | None = None,
                 rejoin_s: float | None = None, prober: Prober = _probe,
                 fence: Callable[[], Any] | None = None) -> None:
        self.client, self.keys, self.who = client, keys, who
        self._fence = fence
        """A transaction compare that holds only while this agent leads (a failure record is
        written under it: after an etcd stall two agents may each think they lead for a round)."""
        self.fault_tolerance, self.ttl, self.deadline_s = fault_tolerance, ttl, deadline_s
        self.window_s = window_s if window_s is not None else 2.0 * ttl
        """Suspicions this close together count as one wave (mass suspicion)."""
        self.rejoin_s = rejoin_s if rejoin_s is not None else 2.0 * ttl
        """How long a suspect that answers may take to register again once etcd answers the leader."""
        self._prober = prober
        self._addresses: dict[int, tuple[int, str]] = {}
        """Plan node -> (incarnation, probe address), from the members last seen live."""
        self._first_seen: dict[int, float] = {}
        """Suspect -> when it turned suspect (monotonic); forgotten once it is back or lost."""
        self._verdict: dict[int, bool] = {}
        """Suspect -> whether it answered its last probe (a verdict changes: a record, an event)."""
        self._stalled_at: float | None = None
        self._stall_unrecorded = False
        self._took_office = time.monotonic()
        self._last_read: float | None = None
        self.cleared = 0
        """Suspects cleared by the probe (each suspicion counted once)."""

    def reset(self) -> None:
        """This agent (again) took office: the gap since its last round is no stall, and every
        suspect has `rejoin_s` from now to register again (it may have taken office after a stall
        that it could not see)."""
        self._last_read = None
        self._took_office = time.monotonic()

    def members(self, record: GenerationRecord) -> dict[int, int]:
        """Plan node -> incarnation of the live members, with the suspects of `record` that
        answered their probe counted live (module doc)."""
        start = time.monotonic()
        idents, _ = read_members(self.client, self.keys)
        end = time.monotonic()
        if end - start > STALL_S or (self._last_read is not None and start - self._last_read > self.ttl):
            self.note_stall(end)
        self._last_read = end
        live = self._live(idents)
        missing = {n: inc for n, inc in record.incarnations.items() if n not in live}
        for n in [n for n in self._first_seen if n not in missing]:  # back (registered again) or gone
            self._first_seen.pop(n, None)
            self._verdict.pop(n, None)
        suspects = {n: inc for n, inc in missing.items() if not self._reported(n, inc) and not self._done(n)}
        if suspects:
            live.update(self._witness(suspects, total=len(record.incarnations)))
        if self._stall_unrecorded:  # a stall that every node rode out before this round saw a suspect
            self._note({}, set(), [], mass=True, stalled=True, took=0.0)
        return live

    def note_stall(self, at: float | None = None) -> None:
        """The leader's own etcd requests stalled, or this agent's own lease expired while it lived
        (roles/agent.py): a control-plane stall at `at` (monotonic; default now), recorded by the
        next round that leads."""
        self._stalled_at = time.monotonic() if at is None else at
        self._stall_unrecorded = True

    def _live(self, idents: dict[str, NodeIdentity]) -> dict[int, int]:
        live = {}
        for member_id, ident in idents.items():
            try:
                n = node_of(member_id)
            except ValueError:
                continue
            live[n] = ident.incarnation
            self._addresses[n] = (ident.incarnation, ident.address)
        return live

    def _reported(self, node: int, incarnation: int) -> bool:
        """Whether the node incarnation's failure is recorded (its own report, or a probe's)."""
        value, _ = self.client.get(self.keys.failure(node_id(node), incarnation))
        return value is not None

    def _done(self, node: int) -> bool:
        """Whether the node's workers reported themselves done (finished, drained, stopped): it left."""
        resp = self.client.get_prefix_response(RunKeys(self.keys).prefix("done", node), count_only=True)
        return int(resp.count) > 0

    def _address(self, node: int, incarnation: int) -> str:
        known = self._addresses.get(node)
        if known is not None and known[0] == incarnation:
            return known[1]
        value, _ = self.client.get(self.keys.probe(node_id(node), incarnation))
        return "" if value is None else value.decode()

    def _ask(self, suspects: dict[int, int]) -> set[int]:
        """The suspects whose agent (of that incarnation) answered alive, all probed at once."""
        if not suspects:
            return set()
        addresses = {n: self._address(n, inc) for n, inc in suspects.items()}
        with ThreadPoolExecutor(max_workers=min(32, len(suspects)), thread_name_prefix="probe") as pool:
            answers = dict(zip(addresses, pool.map(lambda a: self._prober(a, self.deadline_s),
                                                   addresses.values()), strict=True))
        return {n for n, a in answers.items()
                if a is not None and a.alive and a.incarnation == suspects[n] and a.node_id == node_id(n)}

    def _witness(self, suspects: dict[int, int], *, total: int) -> dict[int, int]:
        """Probe the suspects; record the silent ones failed; the ones that answered, kept."""
        now = time.monotonic()
        for n in suspects:
            self._first_seen.setdefault(n, now)
        wave = sum(1 for t in self._first_seen.values() if now - t <= self.window_s)
        stalled = self._stalled_at is not None and now - self._stalled_at <= self.window_s
        mass = wave > total / 2 or wave > self.fault_tolerance + 1 or stalled
        answered = self._ask(suspects)
        if mass and len(answered) < len(suspects):  # a control-plane fault: ask the silent ones again
            answered |= self._ask({n: inc for n, inc in suspects.items() if n not in answered})
        took = time.monotonic() - now
        suspects = self._not_reported_since(suspects)
        answered &= set(suspects)
        since = max(self._stalled_at or 0.0, self._took_office)
        cut_off = {n for n in answered if now - max(self._first_seen[n], since) > self.rejoin_s}
        answered -= cut_off
        silent = sorted(set(suspects) - answered)
        for n in silent:
            reason = (f"lease expired; answers the probe but did not register again within {self.rejoin_s:g} s"
                      " (cut off from etcd)" if n in cut_off else
                      f"lease expired and no answer to the probe within {self.deadline_s:g} s")
            self._record_failure(n, suspects[n], reason, took)
        verdict = {n: n in answered for n in suspects}
        if any(self._verdict.get(n) != v for n, v in verdict.items()):
            self.cleared += sum(1 for n in answered if n not in self._verdict)
            self._verdict.update(verdict)
            self._note(suspects, answered, silent, mass=mass, stalled=stalled, took=took)
        for n in silent:
            self._first_seen.pop(n, None)
            self._verdict.pop(n, None)
        return {n: suspects[n] for n in answered}

    def _not_reported_since(self, suspects: dict[int, int]) -> dict[int, int]:
        """The suspects whose own failure report has not landed while they were probed.

        Membership.report_failure writes `failed/<node>/<inc>` before it revokes the lease, so
        a round normally finds the report before it probes. A report that lands while the probe
        runs (one written before that order was fixed, or by any other writer of `failed/`) is
        honoured the same way: the node is lost as reported, at once, neither kept nor recorded
        failed by the probe (its own report, with its reason, stands); its agent, not yet aware
        of its worker's exit, may even have answered alive."""
        reported = {n for n, inc in suspects.items() if self._reported(n, inc)}
        for n in reported:
            self._first_seen.pop(n, None)
            self._verdict.pop(n, None)
        return {n: inc for n, inc in suspects.items() if n not in reported}

    def _record_failure(self, node: int, incarnation: int, reason: str, took: float) -> None:
        """`failed/<node>/<inc>` (refuses its re-registration), and the lease of a registration
        that raced it revoked: from here on the node is lost, as a reported failure is."""
        report = json.dumps({"reporter": self.who, "reason": reason, "time": time.time()})
        txn = self.client.transactions
        ok, _ = self.client.transaction(compare=[] if self._fence is None else [self._fence()],
                                        success=[txn.put(self.keys.failure(node_id(node), incarnation), report)],
                                        failure=[])
        if not ok:
            raise NoLongerLeader(f"node {node} not recorded failed: this agent is no longer the leader")
        value, meta = self.client.get(self.keys.member(node_id(node)))
        if value is not None and meta is not None and NodeIdentity.from_json(value).incarnation == incarnation:
            self.client.revoke_lease(meta.lease_id)
        log.warning("leader %s: node %d (incarnation %d): %s (probes took %.2f s)", self.who, node, incarnation,
                    reason, took)

    def _note(self, suspects: dict[int, int], answered: set[int], silent: list[int], *, mass: bool,
              stalled: bool, took: float) -> None:
        """The verdict into `suspicion` and a `suspects` event."""
        self._stall_unrecorded = self._stall_unrecorded and not stalled
        decision = LOST if silent else STALL if mass else KEPT
        rec = SuspicionRecord(at=time.time(), suspects=sorted(suspects), answered=sorted(answered), silent=silent,
                              mass=mass, stalled=stalled, decision=decision, probe_s=round(took, 3),
                              cleared_total=self.cleared)
        self.client.put(self.keys.suspicion, rec.to_json())
        record_event(self.client, self.keys, who=self.who, kind="suspects", nodes=rec.suspects, answered=rec.answered,
                     silent=silent, mass=mass, stalled=stalled, decision=decision, probe_s=rec.probe_s,
                     cleared_total=self.cleared)
        if not suspects:
            log.warning("leader %s: etcd stalled; every node kept or regained its place: %s", self.who, decision)
            return
        log.warning("leader %s: lease expired for nodes %s; answered the probe: %s; silent: %s%s: %s", self.who,
                    rec.suspects, rec.answered, silent, " (mass suspicion)" if mass else "", decision)
