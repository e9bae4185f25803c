"""Instantiation: cover N live nodes with templates, >= f+1 pipelines, and split the batch.

A pipeline built from template n and given m microbatches takes a_n + m * b_n seconds
(b_n = its slowest stage, a_n = the sum of the others). The plan's iteration time is that of
its slowest pipeline. For a target time T, template n can take at most cap_n(T) microbatches;
T is achievable iff some multiset of templates covers exactly N nodes with P pipelines,
f+1 <= P <= M, and sum of caps >= M (the M microbatches then fit, each pipeline getting at
least one). That is a knapsack over node counts (numpy over templates), and T* is the least
such T among the finite set {a_n + m * b_n}: a binary search. The microbatches of the chosen
multiset are then split greedily (each next microbatch to the pipeline that finishes it
first), which is optimal for a min-max of increasing functions, so the plan runs in T*.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from templates.plan import PipelinePlan, Plan, StagePlan
from templates.search import PipelineTemplate
from templates.template_set import PlanningError, TemplateSet

_EPS = 1e-9


def instantiate(
    tset: TemplateSet, nodes: Sequence[int], *, global_microbatches: int, fault_tolerance: int
) -> Plan:
    """The fastest plan over `nodes` (ids) with at least fault_tolerance + 1 pipelines."""
    node_list = sorted(set(nodes))
    if len(node_list) != len(nodes):
        raise PlanningError("node ids must be distinct")
    sizes = choose_sizes(
        tset, len(node_list), global_microbatches=global_microbatches, fault_tolerance=fault_tolerance
    )
    groups = []
    start = 0
    for size in sizes:
        groups.append(node_list[start : start + size])
        start += size
    return build_plan(tset, groups, global_microbatches=global_microbatches, fault_tolerance=fault_tolerance)


def choose_sizes(
    tset: TemplateSet, num_nodes: int, *, global_microbatches: int, fault_tolerance: int
) -> list[int]:
    """Pipeline sizes (descending) of the fastest template multiset covering `num_nodes` nodes."""
    need = fault_tolerance + 1
    if fault_tolerance < 0:
        raise PlanningError(f"fault tolerance must be >= 0, got {fault_tolerance}")
    if global_microbatches < need:
        raise PlanningError(
            f"{global_microbatches} microbatches cannot feed the {need} pipelines fault tolerance "
            f"{fault_tolerance} needs"
        )
    if not tset.templates or num_nodes < need * tset.min_nodes:
        missing = need * tset.min_nodes - num_nodes
        raise PlanningError(
            f"{num_nodes} nodes cannot form {need} pipelines for fault tolerance {fault_tolerance}: "
            f"each needs at least {tset.min_nodes} nodes, so {need * tset.min_nodes} are needed "
            f"({missing} missing)"
        )
    search = _SizeSearch(tset, num_nodes, global_microbatches, need)
    candidates = search.candidate_times()
    sizes = search.feasible(candidates[-1])
    if sizes is None:
        raise PlanningError(
            f"{num_nodes} nodes cannot be split exactly into {need} or more pipelines of the available "
            f"template sizes {tset.sizes} with at most {global_microbatches} pipelines"
        )
    lo, hi = 0, len(candidates) - 1  # invariant: candidates[hi] is feasible, with `sizes`
    while lo < hi:
        mid = (lo + hi) // 2
        found = search.feasible(candidates[mid])
        if found is None:
            lo = mid + 1
        else:
            hi, sizes = mid, found
    return sorted(sizes, reverse=True)


def split_microbatches(templates: Sequence[PipelineTemplate], total: int) -> list[int]:
    """Integer microbatches per pipeline, >= 1 each, summing to `total`, minimising the slowest."""
    if total < len(templates):
        raise PlanningError(f"{total} microbatches cannot feed {len(templates)} pipelines")
    counts = [1] * len(templates)
    heap = [(t.time_for(2), p) for p, t in enumerate(templates)]
    heapq.heapify(heap)
    for _ in range(total - len(templates)):
        _, p = heapq.heappop(heap)
        counts[p] += 1
        heapq.heappush(heap, (templates[p].time_for(counts[p] + 1), p))
    return counts


def build_plan(
    tset: TemplateSet, groups: Sequence[Sequence[int]], *, global_microbatches: int, fault_tolerance: int
) -> Plan:
    """A plan whose pipeline p runs the template of len(groups[p]) on groups[p] (stage order)."""
    templates = [tset.template(len(group)) for group in groups]
    counts = split_microbatches(templates, global_microbatches)
    pipelines = []
    for group, template, count in zip(groups, templates, counts, strict=True):
        stages = tuple(StagePlan(node=node, layers=rng) for node, rng in zip(group, template.stages, strict=True))
        pipelines.append(PipelinePlan(stages=stages, microbatches=count, iteration_time=template.time_for(count)))
    return Plan(
        num_layers=tset.num_layers,
        microbatch_size=tset.profile.microbatch_size,
        pipelines=tuple(pipelines),
        gpus_per_node=tset.gpus_per_node,
        fault_tolerance=fault_tolerance,
        iteration_time=max(p.iteration_time for p in pipelines),
    )


class _SizeSearch:
    """Feasibility of a target iteration time, as a knapsack over node counts."""

    def __init__(self, tset: TemplateSet, num_nodes: int, microbatches: int, need: int) -> None:
        self.sizes = np.array(tset.sizes, dtype=np.int64)
        temps = [tset.templates[int(n)] for n in self.sizes]
        self.bottleneck = np.array([t.bottleneck for t in temps])
        self.rest = np.array([sum(t.stage_times) - t.bottleneck for t in temps])
        self.num_nodes = num_nodes
        self.microbatches = microbatches
        self.need = need
        most_pipelines = num_nodes // int(self.sizes.min())
        # With enough microbatches for any pipeline count, only "at least need" matters: cap the
        # pipeline-count state at need. Otherwise count pipelines exactly, up to `microbatches`.
        self.capped = microbatches >= most_pipelines
        self.pdim = need + 1 if self.capped else microbatches + 1

    def candidate_times(self) -> np.ndarray:
        m = np.arange(1, self.microbatches + 1, dtype=np.float64)
        return np.unique((self.rest[:, None] + m[None, :] * self.bottleneck[:, None]).ravel())

    def feasible(self, target: float) -> list[int] | None:
        """Pipeline sizes reaching `target` (fewest pipelines on ties), or None."""
        caps = np.floor((target * (1 + _EPS) - self.rest) / self.bottleneck + _EPS)
        caps = np.clip(caps, 0, self.microbatches).astype(np.int64)
        usable = caps >= 1
        sizes, caps = self.sizes[usable], caps[usable]
        index = np.flatnonzero(usable)
        if sizes.size == 0:
            return None
        n_total, pdim = self.num_nodes, self.pdim
        best = np.full((n_total + 1, pdim), -1, dtype=np.int64)  # most capacity; -1: impossible
        choice = np.full((n_total + 1, pdim), -1, dtype=np.int64)
        came_from = np.full((n_total + 1, pdim), -1, dtype=np.int64)
        best[0, 0] = 0
        prev_state = np.arange(pdim) - 1  # state p comes from p - 1 ...
        for v in range(1, n_total + 1):
            fit = sizes <= v
            if not fit.any():
                continue
            prev = best[v - sizes[fit]]  # (templates, pdim)
            shifted = np.full_like(prev, -1)
            shifted[:, 1:] = prev[:, :-1]
            origin = np.broadcast_to(prev_state, prev.shape).copy()
            if self.capped:  # ... and the capped state also from itself
                stay = prev[:, -1] > prev[:, -2]
                shifted[:, -1] = np.where(stay, prev[:, -1], prev[:, -2])
                origin[:, -1] = np.where(stay, pdim - 1, pdim - 2)
            value = np.where(shifted >= 0, shifted + caps[fit][:, None], -1)
            pick = value.argmax(axis=0)
            cols = np.arange(pdim)
            best[v] = value[pick, cols]
            choice[v] = index[fit][pick]
            came_from[v] = origin[pick, cols]
        finals = range(self.need, pdim) if not self.capped else range(pdim - 1, pdim)
        for p in finals:
            if best[n_total, p] >= self.microbatches:
                return self._unwind(choice, came_from, p)
        return None

    def _unwind(self, choice: np.ndarray, came_from: np.ndarray, p: int) -> list[int]:
        out = []
        v = self.num_nodes
        while v > 0:
            size = int(self.sizes[choice[v, p]])
            out.append(size)
            v, p = v - size, int(came_from[v, p])
        return out
