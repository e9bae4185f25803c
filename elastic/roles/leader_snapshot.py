"""What the leader read from etcd in one round, as one plain record: roles/leader.py fills it,
roles/leader_decisions.py decides on it without an etcd client in sight, and a test builds one
by hand for each case of the decision table (tests/roles/test_leader_decisions.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.records.generation import GenerationRecord, HaltRecord
from elastic.records.injection_requests import InjectionRequest
from elastic.records.progress import ProgressRecord
from elastic.records.stop import StopRequest
from elastic.records.stragglers import StragglerRecord
from elastic.records.sync import SyncReport
from elastic.transfer.shards import ShardKey

Holdings = dict[tuple[int, int], tuple[ShardKey, ...]]
"""(node, local_rank) -> the shards that worker reports holding (elastic/roles/holders.py)."""


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """One round's view of the job: the current generation and everything a decision reads."""

    g: int
    """The current generation's number."""
    record: GenerationRecord
    """Its record (plan, incarnations, resume step, ...)."""
    members: dict[int, int]
    """Live node -> its incarnation (`members/`, one lease each)."""
    now: float
    """Wall time of the reading."""
    last_step_ready: int = 0
    """Ranks of g ready for the job's last step (a count of `ready/<g>/<last>/`)."""
    last_step_decision: str | None = None
    """The decision of (g, the job's last step) as it stands: read only while a node is lost."""
    halt: HaltRecord | None = None
    """`halt/<g>`, if written."""
    reports: list[SyncReport] | None = None
    """Every live worker of g's sync report, in (node, local_rank) order; None while some are missing."""
    holdings: Holdings | None = None
    """What live workers report holding, read once the sync reports are complete (a re-plan's
    input); None before, and empty when no worker has reported yet."""
    registered: dict[int, int] = field(default_factory=dict)
    """Live node whose incarnation is not in g -> its workers registered with that incarnation."""
    drain_requests: list[InjectionRequest] = field(default_factory=list)
    """Drain requests without a status yet, in id order."""
    drained: frozenset[tuple[int, int | None]] = frozenset()
    """(node, incarnation) of the drains carried out: never taken back in."""
    stop: StopRequest | None = None
    """The job's stop request (elastic/records/stop.py), once asked."""
    straggler_policy: str = "off"
    """The straggler policy in force: the run's, or the operator's change."""
    stragglers: StragglerRecord | None = None
    """The `stragglers` record; read only under an acting policy or a split made for stragglers."""
    stragglers_unreadable: bool = False
    """That record could not be read this round: no straggler decision."""
    progress: ProgressRecord | None = None
    """The job's progress key; read only when a node is lost under partial replay."""
    spares_noted: frozenset[tuple[int, int]] = frozenset()
    """(node, incarnation) of the spares whose "spare" event this leader recorded already."""
    drains_asked: frozenset[tuple[int, int]] = frozenset()
    """(node, incarnation) of the stragglers this leader asked to drain already (once each)."""

    @property
    def lost(self) -> list[int]:
        """Nodes of g whose incarnation is no longer a live member."""
        return sorted(n for n, inc in self.record.incarnations.items() if self.members.get(n) != inc)


def live_workers(record: GenerationRecord, members: dict[int, int]) -> set[tuple[int, int]]:
    """(node, local_rank) of every live worker of the generation: the sync reports a generation
    change waits for."""
    plan = record.plan
    return {(n, r) for n in plan.nodes if members.get(n) == record.incarnations.get(n)
            for r in range(plan.gpus_per_node)}
