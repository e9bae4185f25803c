"""The leader's latest verdict on nodes whose leases expired (`suspicion`, one key a job).

A lease expiry makes a node a *suspect*; the leader asks a second witness (the node's probe,
elastic/coordinator/probe.py) before it removes it (elastic/roles/leader_suspects.py). Each time
the verdict changes, the leader writes one `SuspicionRecord` here (and an event): `elastic
status` shows it and the metrics endpoint counts the suspects the probe cleared. Written only
when leases expire, never by the step loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.jsonrecord import JsonRecord
from elastic.coordinator.keys import JobKeys

KEPT = "kept"
"""Every suspect answered its probe: no node removed."""
STALL = "control-plane stall: no change"
"""Mass suspicion (or the leader's own etcd requests stalled) and every suspect answered."""
LOST = "lost"
"""Some suspects did not answer: those (only those) are removed."""


@dataclass(frozen=True, kw_only=True)
class SuspicionRecord(JsonRecord):
    """One verdict of the leader's suspect guard."""

    at: float
    """Wall time of the verdict."""
    suspects: list[int] = field(default_factory=list)
    """Plan nodes whose lease expired with no failure report of their own."""
    answered: list[int] = field(default_factory=list)
    """Suspects whose agent answered the probe, alive: they keep their place."""
    silent: list[int] = field(default_factory=list)
    """Suspects that did not answer within the deadline (or answered dead): removed."""
    mass: bool = False
    """Mass suspicion: more than half the nodes, or more than f + 1, in one window, or a stall."""
    stalled: bool = False
    """The leader's own etcd requests stalled in the window."""
    decision: str = KEPT
    """KEPT, STALL or LOST."""
    probe_s: float = 0.0
    """Seconds the probes took."""
    cleared_total: int = 0
    """Suspects cleared by the probe since this leader took office (the metrics' counter)."""


def read_suspicion(client: EtcdClient, keys: JobKeys) -> SuspicionRecord | None:
    """The latest verdict, or None if no lease of the job has expired under a leader yet."""
    value, _ = client.get(keys.suspicion)
    return None if value is None else SuspicionRecord.from_json(value)
