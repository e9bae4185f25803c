"""Partial replay: keep the microbatches an interrupted step finished, recompute only the rest.

A step's gradient is one fixed pairwise sum over the global batch's microbatches (the step's
summation tree, elastic/parallel/blocks.py), so it does not depend on where the microbatches
were summed: kept sums are the sums of whole subtrees (blocks), and each worker's blocks of a
replayed step follow from this record (`kept_sets`) and the plan. When a node fails
mid-step, a pipeline that lost no node finishes its microbatches (its waits ignore a failure
outside it: `AbortSignal.set(local=True)`), and each of its workers keeps its gradient sums for
the layers it holds. Its sync report names them (`PartialReport`). The leader, re-planning,
keeps the microbatches of every pipeline whose workers all report them (`resolve_replay`); the
others are recomputed. The next generation's first step computes only the missing microbatches,
spread over its pipelines (`split_microbatches`), and the keepers add their sums before the
cross-pipeline reduction: the step commits with the failure-free step's gradient.

Where the new plan moves a kept layer to another node, its kept sums move with it (`moved`:
the keeper sends them to one new holder of the layer over the new generation's process group
while the shards move, and that holder adds them instead); a keeper that left the plan, or sits
at another tensor-parallel rank, makes its set recomputed (`recomputed` says why). This module
imports no torch: the leader uses it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from elastic.coordinator.jsonrecord import JsonRecord
from templates.plan import Plan, StagePlan

FINISH_FROM = 1 / 3
"""Fraction of a step after which pipelines that lost no node finish their microbatches when a
node fails (before it they stop at once and the whole step is replayed). Finishing costs the
rest of their step before the re-plan; stopping costs recomputing their part on the new plan.
With n_p pipelines, a new plan of about the same speed and a failure at fraction x of the step,
finishing costs ~(1 - x) + 1/n_p steps against ~1 step for stopping: it pays from x ~ 1/n_p,
and the 2 x 2 gpt2-124m run here breaks even at x ~ 0.34 (bench/README.md)."""


def worth_finishing(elapsed_s: float, step_s: float) -> bool:
    """Whether a step `elapsed_s` into its run (steps take about `step_s`) is far enough along
    for the intact pipelines to finish it (`FINISH_FROM`)."""
    return step_s <= 0 or elapsed_s >= FINISH_FROM * step_s


@dataclass(frozen=True, kw_only=True)
class PartialReport(JsonRecord):
    """Gradient sums a worker kept from an interrupted step: what its sync report says."""

    step: int
    """The interrupted step."""
    microbatches: tuple[int, ...]
    """Global microbatch indices whose gradients the sums hold (its pipeline's, all finished)."""
    layers: tuple[int, int]
    """The planning layers [first, last) the sums cover (chunk 0's, under interleaving)."""
    tp_rank: int
    """Their tensor-parallel rank."""
    chunks: tuple[tuple[int, int], ...] = ()
    """Under interleaving, the layer range of each chunk the sums cover; empty: `layers`."""

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return self.chunks or (self.layers,)

    def held(self) -> list[int]:
        """Every layer the sums cover, ascending."""
        return sorted(layer for first, last in self.ranges for layer in range(first, last))


def to_runs(values: Sequence[int]) -> list[list[int]]:
    """Ascending distinct ints as [start, end) runs of consecutive values."""
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][1] == v:
            runs[-1][1] = v + 1
        else:
            runs.append([v, v + 1])
    return runs


def from_runs(runs: Sequence[Sequence[int]]) -> list[int]:
    """The ints of [start, end) runs, in order."""
    return [v for start, end in runs for v in range(start, end)]


@dataclass(frozen=True, kw_only=True)
class ReplayRecord(JsonRecord):
    """How a generation's first step reuses the interrupted step's finished microbatches.

    It fans out to every worker inside the generation record, so its size follows the kept sets
    (one per intact pipeline), not the workers or the microbatches: microbatches are [start, end)
    runs, and a set's keepers are its nodes (each node's every local rank keeps one
    tensor-parallel shard). At 2,048 nodes x 8 GPUs and 16,384 microbatches a lost node's record
    is a few tens of KB (its earlier per-worker form was 2.8 MB, more than etcd takes in one put).
    `kept`, `keepers` and `kept_sets` give the per-worker view."""

    step: int
    """The interrupted step (the generation's resume step)."""
    total: int
    """Microbatches of the global batch."""
    tp: int = 1
    """Tensor-parallel degree: a keeper node's local ranks 0 .. tp - 1 keep (one shard each)."""
    set_runs: list[list[list[int]]] = field(default_factory=list)
    """Per kept set (a pipeline's finished microbatches, ascending sets), its microbatches as
    [start, end) runs."""
    set_nodes: list[list[int]] = field(default_factory=list)
    """Per kept set (same order), the nodes whose workers add its sums to the step."""
    recomputed: list[str] = field(default_factory=list)
    """Finished microbatches recomputed anyway, and why (e.g. a keeper left the plan)."""
    moved: list[list[int]] = field(default_factory=list)
    """[layer, tp_rank, from_node, from_local_rank, to_node, to_local_rank]: kept sums of a layer
    whose keeper no longer holds it, sent to (and added by) a new holder."""

    def __post_init__(self) -> None:
        if len(self.set_runs) != len(self.set_nodes):
            raise ValueError(f"replay record of step {self.step} has {len(self.set_runs)} kept sets but "
                             f"{len(self.set_nodes)} lists of their nodes")
        if self.tp < 1:
            raise ValueError(f"replay record of step {self.step}: tp must be >= 1, got {self.tp}")

    @functools.cached_property
    def kept(self) -> list[int]:
        """Global microbatches whose gradients survivors kept (not recomputed), ascending."""
        return sorted(v for runs in self.set_runs for v in from_runs(runs))

    @functools.cached_property
    def keepers(self) -> list[list[int]]:
        """[node, local_rank] of every worker that adds its kept sums to the step, ascending."""
        return [[node, t] for node, _ in self._keeper_nodes for t in range(self.tp)]

    @functools.cached_property
    def kept_sets(self) -> list[list[int]]:
        """Per keeper (the order of `keepers`), the microbatches its sums hold."""
        return [mbs for _, mbs in self._keeper_nodes for _ in range(self.tp)]

    @functools.cached_property
    def _keeper_nodes(self) -> list[tuple[int, list[int]]]:
        return sorted((node, from_runs(runs)) for runs, nodes in zip(self.set_runs, self.set_nodes, strict=True)
                      for node in nodes)

    @property
    def missing(self) -> list[int]:
        """The microbatches the generation computes, ascending."""
        kept = set(self.kept)
        return [m for m in range(self.total) if m not in kept]

    @property
    def replayed_fraction(self) -> float:
        """Share of the step's microbatches computed again."""
        return len(self.missing) / self.total if self.total else 1.0

    def is_keeper(self, node: int, local_rank: int) -> bool:
        return 0 <= local_rank < self.tp and any(node in nodes for nodes in self.set_nodes)


def split_microbatches(plan: Plan, microbatches: Sequence[int]) -> list[tuple[int, ...]]:
    """Spread `microbatches` (ascending) over `plan`'s pipelines in proportion to the share of
    the global batch each takes (largest remainder, ties to the lower pipeline), as contiguous
    runs in pipeline order. The same on every worker."""
    out, start = [], 0
    for size in plan.spread(len(microbatches)):
        out.append(tuple(microbatches[start : start + size]))
        start += size
    return out


def _stage_layers(plan: Plan) -> dict[int, StagePlan]:
    """Each node's stage in `plan` (its layers: `StagePlan.holds`)."""
    return {stage.node: stage for pipe in plan.pipelines for stage in pipe.stages}


def _first_holders(plan: Plan) -> list[int]:
    """Per layer, the node of the first pipeline's stage that holds it in `plan`."""
    out = [-1] * plan.num_layers
    for pipe in reversed(plan.pipelines):
        for st in pipe.stages:
            for first, last in st.ranges:
                out[first:last] = [st.node] * (last - first)
    return out


def resolve_replay(
    new_plan: Plan, reports: Sequence[tuple[int, int, PartialReport | None]], *, step: int
) -> ReplayRecord:
    """Which of step `step`'s microbatches the generation of `new_plan` keeps.

    `reports`: (node, local_rank, kept sums or None) of every live worker. A set of microbatches
    is kept when its reports cover every (layer, tensor-parallel rank) shard of the model once
    and every keeper is in `new_plan` at the same rank; the sums of a layer its keeper no longer
    holds go to the first pipeline's holder of it (`moved`). O(reports x their layers).
    """
    tp = new_plan.gpus_per_node
    shards = {(layer, t) for layer in range(new_plan.num_layers) for t in range(tp)}
    by_set: dict[tuple[int, ...], list[tuple[int, int, PartialReport]]] = {}
    for node, local_rank, report in reports:
        if report is not None and report.step == step:
            by_set.setdefault(report.microbatches, []).append((node, local_rank, report))
    layers_of, first_holder = _stage_layers(new_plan), _first_holders(new_plan)
    kept: set[int] = set()
    sets: list[tuple[tuple[int, ...], list[int]]] = []
    recomputed: list[str] = []
    moved_sums: list[list[int]] = []
    for mbs, group in sorted(by_set.items()):
        covered = {(layer, r.tp_rank) for _, _, r in group for layer in r.held()}
        count = sum(len(r.held()) for _, _, r in group)  # == len(shards) only if none twice
        if count != len(shards) or covered != shards or not kept.isdisjoint(mbs):
            continue  # a pipeline that lost a worker: its sums are incomplete
        nodes = sorted({node for node, _, _ in group})
        if sorted((node, local_rank) for node, local_rank, _ in group) != [(n, t) for n in nodes for t in range(tp)]:
            continue  # not every local rank of its nodes (the record names keepers by node)
        gone = sorted({node for node, local_rank, r in group if node not in layers_of or local_rank != r.tp_rank})
        if gone:
            recomputed.append(f"microbatches {list(mbs)}: kept by node(s) {gone}, which are not in the new plan "
                              "at the same tensor-parallel rank")
            continue
        for node, local_rank, r in group:
            stage = layers_of[node]
            moved_sums.extend([layer, r.tp_rank, node, local_rank, first_holder[layer], r.tp_rank]
                              for layer in r.held() if not stage.holds(layer))
        kept.update(mbs)
        sets.append((mbs, nodes))
    return ReplayRecord(step=step, total=new_plan.global_microbatches, tp=tp,
                        set_runs=[to_runs(sorted(mbs)) for mbs, _ in sets], set_nodes=[nodes for _, nodes in sets],
                        recomputed=recomputed, moved=sorted(moved_sums))
