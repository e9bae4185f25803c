"""Rank maths and group lookups of a plan, the same for every worker: pure functions of the plan.

Ranks are dealt pipeline by pipeline, stage by stage, tensor-parallel rank by tensor-parallel
rank (`layout.assign_ranks`), so the global rank of (pipeline, stage, tp_rank) is arithmetic.
From it follow the groups a generation needs: each node's tensor-parallel group, and the
gradient buckets (consecutive layers held by the same workers, one per pipeline), each one
group. `ParallelLayout` (layout.py) is one worker's view of these.
"""

from __future__ import annotations

from dataclasses import dataclass

from templates.plan import Plan


@dataclass(frozen=True, kw_only=True)
class GradBucket:
    """Consecutive layers held by the same set of workers: one all-reduce per step."""

    layers: tuple[int, ...]
    """Planning layers in the bucket, ascending and consecutive."""
    ranks: tuple[int, ...]
    """Global ranks (one per pipeline) holding these layers at this tensor-parallel rank, sorted."""


def rank_of(plan: Plan, pipeline: int, stage: int, tp_rank: int) -> int:
    """Global rank of the worker at (pipeline, stage, tp_rank)."""
    tp = plan.gpus_per_node
    before = sum(len(p.stages) for p in plan.pipelines[:pipeline])
    return (before + stage) * tp + tp_rank


def tp_group_of(plan: Plan, pipeline: int, stage: int) -> tuple[int, ...]:
    """Global ranks of the tensor-parallel group (one node's workers) of (pipeline, stage)."""
    base = rank_of(plan, pipeline, stage, 0)
    return tuple(range(base, base + plan.gpus_per_node))


def holders(plan: Plan, layer: int, tp_rank: int) -> tuple[int, ...]:
    """Global ranks, one per pipeline, that hold (layer, tp_rank); sorted."""
    if not 0 <= layer < plan.num_layers:
        raise ValueError(f"layer {layer} outside [0, {plan.num_layers})")
    out = []
    for p, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            if stage.holds(layer):
                out.append(rank_of(plan, p, s, tp_rank))
    return tuple(sorted(out))


def buckets_of(plan: Plan, pipeline: int, stage: int, tp_rank: int) -> tuple[GradBucket, ...]:
    """The layers of (pipeline, stage) grouped into gradient buckets at `tp_rank`, ascending (a
    bucket never spans two chunks of an interleaved stage: its layers are consecutive)."""
    out: list[GradBucket] = []
    for layer in plan.pipelines[pipeline].stages[stage].held:
        ranks = holders(plan, layer, tp_rank)
        if out and out[-1].ranks == ranks and out[-1].layers[-1] == layer - 1:
            out[-1] = GradBucket(layers=out[-1].layers + (layer,), ranks=ranks)
        else:
            out.append(GradBucket(layers=(layer,), ranks=ranks))
    return tuple(out)


def all_group_ranks(plan: Plan) -> tuple[tuple[int, ...], ...]:
    """Every multi-member group of the plan (tensor-parallel groups, then gradient-bucket
    groups), deduplicated, in one order that every worker computes identically."""
    seen: set[tuple[int, ...]] = set()
    ordered: list[tuple[int, ...]] = []

    def add(ranks: tuple[int, ...]) -> None:
        if len(ranks) > 1 and ranks not in seen:
            seen.add(ranks)
            ordered.append(ranks)

    for p, pipe in enumerate(plan.pipelines):
        for s in range(len(pipe.stages)):
            add(tp_group_of(plan, p, s))
    for p, pipe in enumerate(plan.pipelines):
        for s in range(len(pipe.stages)):
            for t in range(plan.gpus_per_node):
                for bucket in buckets_of(plan, p, s, t):
                    add(bucket.ranks)
    return tuple(ordered)
