"""A generation's record and how the leader stops one: `GenerationRecord` (at `plan/<g>`, published
with `Generations.publish`), `HaltRecord` (at `halt/<g>`) and the step `Vote` both carry.

Every JSON record here is a `JsonRecord` (elastic/coordinator/jsonrecord.py): its JSON comes from
its fields and carries the schema version `"v"` (a record without one is version 1); the keys
are listed in elastic/coordinator/schema.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.coordinator.jsonrecord import JsonRecord, RecordError
from elastic.parallel.shard_moves import MoveRow
from elastic.records.partial import ReplayRecord
from templates.optim_slices import OwnerRows, SliceOwnership, owners_from_rows, plan_owners
from templates.plan import Plan


@dataclass(frozen=True, kw_only=True)
class GenerationRecord(JsonRecord):
    """One generation: its plan and why and from where training goes on under it."""

    plan: Plan
    """The plan of this generation."""
    resume_step: int
    """The next step to run (the first step of this generation)."""
    incarnations: dict[int, int]
    """Plan node -> the incarnation of that node taking part in this generation."""
    lost: list[int] = field(default_factory=list)
    """Nodes of the previous generation that are gone."""
    joined: list[int] = field(default_factory=list)
    """Nodes new in this generation."""
    drained: list[int] = field(default_factory=list)
    """Nodes of the previous generation removed on request (`elastic drain`): their workers
    serve their shards until this generation has committed a step, then leave with code 0."""
    restore_checkpoint: int | None = None
    """Checkpoint step every worker restores from (None: survivors keep their state)."""
    restore_dir: str | None = None
    """Directory of that checkpoint when it is not the job's own (a resumed run's generation 1:
    the earlier run's checkpoints, resharded to this plan's tensor-parallel degree)."""
    reason: str = "start"
    """Why this generation exists, in words."""
    detected_at: float | None = None
    """Wall time at which the leader saw the change (loss or join)."""
    published_at: float | None = None
    """Wall time at which the leader published this record."""
    synced_at: float | None = None
    """Wall time at which every live worker of the previous generation had reported (after a
    loss: once the pipelines that lost no node finished their microbatches)."""
    completed_vote: Vote | None = None
    """The vote of step `resume_step - 1` as a survivor saw it complete: a survivor whose own
    wait on that vote was cut short (it holds the step's reduced gradients, pending) commits the
    step with it before joining, so every survivor enters at `resume_step`."""
    replay: ReplayRecord | None = None
    """Step `resume_step` was interrupted: which of its microbatches survivors kept, so this
    generation computes only the others (None: the whole step is run)."""
    balanced_for: list[int] = field(default_factory=list)
    """The straggler nodes this plan's microbatch split allows for (`--straggler-policy
    rebalance`, elastic/planning/stragglers.py); empty: the planner's own split."""
    moves: list[MoveRow] | None = None
    """The collective shard path's moves into this generation (elastic/parallel/shard_moves.py):
    (layer, tp rank, sending rank, receiving rank) in this plan's ranks, planned by the leader from
    the holdings every worker reported; None when that path is not taken (the gRPC shard path, a
    checkpoint restore, the first generation). Every worker carries out the same list."""

    slice_owners: OwnerRows | None = None
    """The sharded optimizer's owners of every layer's slices under this plan (`rows[layer][j]`:
    the nodes owning slice j, templates/optim_slices.py), chosen by the leader to keep each
    surviving owner on its slice (`plan_owners(..., previous=)`); None: the plan's own
    (`plan_owners(plan)`), as after a start or a checkpoint restore, or when not sharded."""

    def __post_init__(self) -> None:
        if self.slice_owners is not None:
            try:
                owners_from_rows(self.plan, self.slice_owners)
            except ValueError as exc:
                raise RecordError(f"GenerationRecord.slice_owners: {exc}") from None

    def owners(self) -> dict[int, SliceOwnership]:
        """Every layer's slice owners under this generation (`slice_owners`, else the plan's own)."""
        if self.slice_owners is None:
            return plan_owners(self.plan)
        return owners_from_rows(self.plan, self.slice_owners)

    @property
    def replayed_fraction(self) -> float | None:
        """Share of the interrupted step computed again (None when no step was interrupted:
        a join or a drain at a step boundary, or the first generation)."""
        if self.replay is not None:
            return self.replay.replayed_fraction
        return 1.0 if self.lost and self.restore_checkpoint is None else None


@dataclass(frozen=True, kw_only=True)
class Vote:
    """The outcome of a step's vote (its world all-reduce), the same on every worker that saw it."""

    step: int
    """Index of the step voted on."""
    grad_norm: float
    """Global gradient norm before clipping (the clip factor follows from it)."""
    loss: float
    """Mean global-batch loss."""


@dataclass(frozen=True, kw_only=True)
class HaltRecord(JsonRecord):
    """The leader's request that generation g stop: `abort` (a member is lost: drop the in-flight
    step unless its vote completed) or at the next step boundary (a join or a drain)."""

    abort: bool
    """True: abandon the in-flight step now; False: finish it and stop after its commit."""
    reason: str
    """Why, in words."""
    at: float
    """Wall time the leader wrote it."""
    lost: list[int] = field(default_factory=list)
    """With `abort`: the lost nodes. A pipeline with none of them finishes its microbatches and
    keeps their gradients (partial replay); empty: every pipeline stops at once."""
    stop_step: int | None = None
    """A whole-job stop (elastic/records/stop.py): written over a boundary halt once every live
    worker of g reported S committed steps. No generation follows: each worker writes its
    checkpoint of step S, waits until it is on disk, reports itself done and exits 0."""
