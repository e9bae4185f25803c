"""ParallelLayout: where every worker of a plan sits, and which groups it needs.

Built from (plan, generation, node, local rank) with no communication: every worker derives
the same global ranks from the plan alone. Ranks are dealt pipeline by pipeline, stage by stage,
tensor-parallel rank by tensor-parallel rank, so pipeline 0 stage 0 tp 0 is rank 0. The rank
maths and group lookups over the whole plan are pure functions of it (plan_ranks.py).

A new generation means a new layout; nothing here is ever patched in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.parallel import plan_ranks
from elastic.parallel.plan_ranks import GradBucket
from templates.optim_slices import SliceOwnership
from templates.plan import Plan, PlanError, StagePlan


@dataclass(frozen=True, kw_only=True)
class WorkerCoord:
    """Position of one worker in the plan."""

    rank: int
    """Global rank of the worker in this generation's world."""
    node: int
    """Node (unit of failure) that runs the worker."""
    local_rank: int
    """Index of the worker inside its node; equals its tensor-parallel rank."""
    pipeline: int
    """Pipeline replica the worker belongs to."""
    stage: int
    """Stage of that pipeline the worker runs."""

    @property
    def tp_rank(self) -> int:
        return self.local_rank


def assign_ranks(plan: Plan) -> tuple[WorkerCoord, ...]:
    """Every worker of the plan, indexed by global rank."""
    coords: list[WorkerCoord] = []
    for p, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            for t in range(plan.gpus_per_node):
                coords.append(
                    WorkerCoord(rank=len(coords), node=stage.node, local_rank=t, pipeline=p, stage=s)
                )
    return tuple(coords)


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """One worker's view of a plan: its coordinates, neighbours and groups."""

    plan: Plan
    """The plan this layout instantiates."""
    generation: int
    """Plan version; process groups of different generations never mix."""
    node: int
    """Node of this worker."""
    local_rank: int
    """Worker index inside the node (= tensor-parallel rank)."""
    owners: tuple[SliceOwnership, ...] | None = field(default=None, repr=False)
    """The sharded optimizer's slice owners of every layer, by layer (the generation record's
    `slice_owners`); None: the plan's own (`plan_owners`). Read through
    `elastic.engine.optim_shards.slice_owners`."""
    workers: tuple[WorkerCoord, ...] = field(init=False, repr=False)
    """Every worker of the plan, indexed by global rank."""

    def __post_init__(self) -> None:
        if self.generation < 0:
            raise ValueError(f"generation must be >= 0, got {self.generation}")
        if not 0 <= self.local_rank < self.plan.gpus_per_node:
            raise ValueError(
                f"local rank {self.local_rank} outside [0, {self.plan.gpus_per_node}) (gpus per node)"
            )
        self.plan.locate(self.node)  # PlanError if the node is not in the plan
        object.__setattr__(self, "workers", assign_ranks(self.plan))

    @classmethod
    def for_rank(cls, plan: Plan, generation: int, rank: int) -> ParallelLayout:
        """The layout of the worker with global rank `rank`."""
        workers = assign_ranks(plan)
        if not 0 <= rank < len(workers):
            raise PlanError(f"rank {rank} outside the plan's world of {len(workers)} workers")
        w = workers[rank]
        return cls(plan=plan, generation=generation, node=w.node, local_rank=w.local_rank)

    # ---- me ------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def rank(self) -> int:
        return plan_ranks.rank_of(self.plan, *self.plan.locate(self.node), self.local_rank)

    @property
    def pipeline(self) -> int:
        return self.workers[self.rank].pipeline

    @property
    def stage(self) -> int:
        return self.workers[self.rank].stage

    @property
    def tp_rank(self) -> int:
        return self.local_rank

    @property
    def tp_size(self) -> int:
        return self.plan.gpus_per_node

    @property
    def num_stages(self) -> int:
        return len(self.plan.pipelines[self.pipeline].stages)

    @property
    def stage_plan(self) -> StagePlan:
        """My stage in the plan: its layers (`layers` without interleaving; every chunk's
        `ranges`, all of them `held`, with it)."""
        return self.plan.pipelines[self.pipeline].stages[self.stage]

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def num_microbatches(self) -> int:
        return self.plan.pipelines[self.pipeline].microbatches

    @property
    def microbatch_offset(self) -> int:
        """Global index of this pipeline's first microbatch."""
        return self.plan.microbatch_offset(self.pipeline)

    # ---- neighbours and groups (the plan-wide lookups: plan_ranks.py) ---------------------

    @property
    def tp_ranks(self) -> tuple[int, ...]:
        """Global ranks of my tensor-parallel group (my node's workers)."""
        return plan_ranks.tp_group_of(self.plan, self.pipeline, self.stage)

    @property
    def prev_rank(self) -> int | None:
        """Same tensor-parallel rank on the previous stage; None on the first stage."""
        if self.is_first_stage:
            return None
        return plan_ranks.rank_of(self.plan, self.pipeline, self.stage - 1, self.tp_rank)

    @property
    def next_rank(self) -> int | None:
        """Same tensor-parallel rank on the next stage; None on the last stage."""
        if self.is_last_stage:
            return None
        return plan_ranks.rank_of(self.plan, self.pipeline, self.stage + 1, self.tp_rank)

    def holders(self, layer: int, tp_rank: int | None = None) -> tuple[int, ...]:
        """Global ranks, one per pipeline, that hold (layer, tp_rank) (default: mine); sorted."""
        return plan_ranks.holders(self.plan, layer, self.tp_rank if tp_rank is None else tp_rank)

    @property
    def buckets(self) -> tuple[GradBucket, ...]:
        """My layers grouped into gradient buckets, ascending by layer."""
        return plan_ranks.buckets_of(self.plan, self.pipeline, self.stage, self.tp_rank)

    def counts_layer_for_norm(self, layer: int) -> bool:
        """Whether this worker's copy of `layer` counts in the global gradient norm: after the
        cross-pipeline all-reduce every holder has the same gradient, so only the holder with
        the lowest rank counts it."""
        return self.holders(layer)[0] == self.rank
