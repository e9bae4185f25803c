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
from typing import Protocol

import numpy as np

from templates.counted_knapsack import Counted, least_target
from templates.flat_knapsack import FlatKnapsack
from templates.plan import PipelinePlan, Plan, StagePlan
from templates.search import PipelineTemplate
from templates.template_set import PlanningError, TemplateSet

_EPS = 1e-9
_PROBES = 48
_LADDER = np.array([0.0, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0])


def instantiate(
    tset: TemplateSet, nodes: Sequence[int], *, global_microbatches: int, fault_tolerance: int
) -> Plan:
    """The fastest plan over `nodes` (ids) with at least `tset.pipelines_needed(fault_tolerance)`
    pipelines (f + 1; S (f + 1) from templates counting 1/S of the moments); from
    `tset.fallback`'s templates where these have none."""
    node_list = sorted(set(nodes))
    if len(node_list) != len(nodes):
        raise PlanningError("node ids must be distinct")
    try:
        sizes = choose_sizes(
            tset, len(node_list), global_microbatches=global_microbatches, fault_tolerance=fault_tolerance
        )
    except PlanningError:
        if tset.fallback is None:
            raise
        return instantiate(tset.fallback, nodes, global_microbatches=global_microbatches,
                           fault_tolerance=fault_tolerance)
    groups = []
    start = 0
    for size in sizes:
        groups.append(node_list[start : start + size])
        start += size
    return build_plan(tset, groups, global_microbatches=global_microbatches, fault_tolerance=fault_tolerance)


def choose_sizes(
    tset: TemplateSet, num_nodes: int, *, global_microbatches: int, fault_tolerance: int
) -> list[int]:
    """Pipeline sizes (descending) of the fastest template multiset covering `num_nodes` nodes
    (remembered in `tset.memo`: the same inputs give the same sizes)."""
    key = (num_nodes, global_microbatches, fault_tolerance)
    found = tset.memo.get(key)
    if found is None:
        try:
            found = tuple(_fastest_sizes(tset, num_nodes, global_microbatches, fault_tolerance))
        except PlanningError as exc:
            found = str(exc)
        tset.memo.put(key, found)
    if isinstance(found, str):
        raise PlanningError(found)
    return list(found)


def _fastest_sizes(tset: TemplateSet, num_nodes: int, global_microbatches: int, fault_tolerance: int) -> list[int]:
    if fault_tolerance < 0:
        raise PlanningError(f"fault tolerance must be >= 0, got {fault_tolerance}")
    need = tset.pipelines_needed(fault_tolerance)
    why = f"fault tolerance {fault_tolerance}" + (
        f" with each holder keeping 1/{tset.moment_slices} of its moments" if tset.moment_slices > 1 else "")
    if global_microbatches < need:
        raise PlanningError(f"{global_microbatches} microbatches cannot feed the {need} pipelines {why} needs")
    if not tset.templates or num_nodes < need * tset.min_nodes:
        missing = need * tset.min_nodes - num_nodes
        raise PlanningError(
            f"{num_nodes} nodes cannot form {need} pipelines for {why}: "
            f"each needs at least {tset.min_nodes} nodes, so {need * tset.min_nodes} are needed "
            f"({missing} missing)"
        )
    search = _SizeSearch(tset, num_nodes, global_microbatches, need)
    if search.capped:
        sizes = _ladder_sizes(search)
    else:  # fewer microbatches than some covers have pipelines: counted_knapsack.py
        problem = Counted(sizes=search.sizes, num_nodes=num_nodes, need=need, microbatches=global_microbatches)
        layers = least_target(problem, search.candidate_times(), search.caps_at)
        sizes = None if layers is None else layers.sizes()
    if sizes is None:
        raise PlanningError(
            f"{num_nodes} nodes cannot be split exactly into {need} or more pipelines of the available "
            f"template sizes {tset.sizes} with at most {global_microbatches} pipelines"
        )
    return sorted(sizes, reverse=True)


def _ladder_sizes(search: _SizeSearch) -> list[int] | None:
    """The sizes of the least reachable target by `search.feasible` (None if none is): the
    search for counts capped at f + 1, and, on any input, the reference for counted_knapsack.py."""
    candidates = search.candidate_times()
    # Bracket the answer first: a relaxation bound, then a geometric ladder of targets above it
    # up to the slowest candidate (feasible there, or nowhere).
    bound = search.lower_bound()
    ladder = np.append(bound * (1 + _LADDER), candidates[-1])
    reached = search.feasible(ladder)
    if not reached.any():
        return None
    # A many-way search: each round probes up to _PROBES targets in one vectorised DP.
    # Invariant: candidates[hi] is feasible and the answer lies in [lo, hi].
    first = int(np.argmax(reached))
    hi = int(np.searchsorted(candidates, ladder[first] * (1 + _EPS), side="right")) - 1
    lo = int(np.searchsorted(candidates, (ladder[first - 1] if first else bound) * (1 - _EPS)))
    lo = min(lo, hi)
    while lo < hi:
        probes = np.unique(np.linspace(lo, hi - 1, num=min(_PROBES, hi - lo)).round().astype(np.int64))
        ok = search.feasible(candidates[probes])
        if ok.any():
            first = int(np.argmax(ok))
            hi = int(probes[first])
            lo = int(probes[first - 1]) + 1 if first > 0 else lo
        else:
            lo = int(probes[-1]) + 1
    return search.sizes_for(float(candidates[hi]))


class Timed(Protocol):
    """A pipeline's time for a number of microbatches (a template, or one at other speeds)."""

    def time_for(self, microbatches: int) -> float: ...


def split_microbatches(templates: Sequence[Timed], total: int) -> list[int]:
    """Integer microbatches per pipeline, >= 1 each, summing to `total`, minimising the slowest."""
    if total < len(templates):
        raise PlanningError(f"{total} microbatches cannot feed {len(templates)} pipelines")
    # The greedy below hands out the (time_for(m), p), m >= 2, in sorted order. Every pair below a
    # threshold comes before every other pair, so a threshold that no more than the extra
    # microbatches stay under gives those counts at once; the heap then hands out the rest, as it
    # would have. Identical pipelines (the same object) are counted once.
    counts = _below(templates, total - len(templates))
    left = total - sum(counts)
    if not left:
        return counts
    heap = [(t.time_for(c + 1), p) for p, (t, c) in enumerate(zip(templates, counts, strict=True))]
    heapq.heapify(heap)
    for _ in range(left):
        _, p = heapq.heappop(heap)
        counts[p] += 1
        heapq.heappush(heap, (templates[p].time_for(counts[p] + 1), p))
    return counts


def _below(templates: Sequence[Timed], extra: int) -> list[int]:
    """1 + the m >= 2 with time_for(m) < theta, per pipeline, for a theta under which at most
    `extra` such m lie in all (found by bisection; times must increase with m)."""
    if extra <= len(templates) or not templates:
        return [1] * len(templates)
    distinct = {id(t): t for t in templates}
    copies: dict[int, int] = {}
    for t in templates:
        copies[id(t)] = copies.get(id(t), 0) + 1
    cap = extra + 1

    def under(t: Timed, theta: float) -> int:  # the m in [2, cap] with time_for(m) < theta, minus 1
        lo, hi = 1, cap  # time_for(lo) < theta or lo == 1; the answer is in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if t.time_for(mid) < theta:
                lo = mid
            else:
                hi = mid - 1
        return lo - 1

    def total_under(theta: float) -> int:
        return sum(under(t, theta) * copies[key] for key, t in distinct.items())

    low = min(t.time_for(2) for t in distinct.values())  # nothing is under it
    high = max(t.time_for(cap) for t in distinct.values())
    for _ in range(40):
        mid = (low + high) / 2
        if total_under(mid) <= extra:
            low = mid
        else:
            high = mid
    found = {key: 1 + under(t, low) for key, t in distinct.items()}
    return [found[id(t)] for t in templates]


def build_plan(
    tset: TemplateSet, groups: Sequence[Sequence[int]], *, global_microbatches: int, fault_tolerance: int
) -> Plan:
    """A plan whose pipeline p runs the template of len(groups[p]) on groups[p] (stage order)."""
    templates = [tset.template(len(group)) for group in groups]
    counts = split_microbatches(templates, global_microbatches)
    pipelines = [PipelinePlan(stages=template_stages(template, group), microbatches=count,
                              iteration_time=template.time_for(count))
                 for group, template, count in zip(groups, templates, counts, strict=True)]
    return plan_of(tset, pipelines, fault_tolerance=fault_tolerance)


def template_stages(template: PipelineTemplate, group: Sequence[int]) -> tuple[StagePlan, ...]:
    """The stages of `template` run by the nodes of `group`, in stage order."""
    chunks = template.chunks or ((),) * len(group)
    return tuple(StagePlan(node=node, layers=rng, recompute=mode, chunks=ranges)
                 for node, rng, mode, ranges in zip(group, template.stages, template.stage_modes, chunks, strict=True))


def plan_of(tset: TemplateSet, pipelines: Sequence[PipelinePlan], *, fault_tolerance: int) -> Plan:
    """The plan of these pipelines of `tset`'s model, as slow as its slowest pipeline."""
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
        chunks = np.array([t.virtual_stages for t in temps], dtype=np.float64)
        # time_for(m) >= rest + m * bottleneck (equal under 1F1B; interleaved, the padding of a
        # last group of fewer than p microbatches comes on top): what the bound relaxes.
        self.rest = np.array([sum(t.stage_times) - t.bottleneck for t in temps]) / chunks
        self.num_nodes = num_nodes
        self.microbatches = microbatches
        m = np.arange(1, microbatches + 1, dtype=np.int64)
        padding = -(-m[None, :] // self.sizes[:, None]) * self.sizes[:, None] - m[None, :]
        self.times = (self.rest[:, None] + m[None, :] * self.bottleneck[:, None]
                      + padding * ((chunks - 1) / chunks * self.bottleneck)[:, None])
        """times[t, m - 1]: template t's `time_for(m)` (`templates.cost.pipeline_time`), rising in m."""
        self.need = need
        most_pipelines = num_nodes // int(self.sizes.min())
        # With enough microbatches for any pipeline count, only "at least need" matters: cap the
        # pipeline-count state at need. Otherwise count pipelines exactly, up to `microbatches`.
        self.capped = microbatches >= most_pipelines
        self.pdim = need + 1 if self.capped else microbatches + 1
        # Every cover of N nodes then has at least `need` pipelines and at most M: no count to track.
        self.flat = self.capped and num_nodes >= need * int(self.sizes.max())

    def lower_bound(self) -> float:
        """No plan beats this: each node takes at most (T - a_n) / (n b_n) microbatches."""
        per_node = self.microbatches / self.num_nodes
        return float(np.min(self.rest + per_node * self.sizes * self.bottleneck))

    def candidate_times(self) -> np.ndarray:
        return np.unique(self.times.ravel())

    def feasible(self, targets: np.ndarray) -> np.ndarray:
        """Whether each target iteration time is reachable (one DP for all targets)."""
        targets = np.asarray(targets, dtype=np.float64)
        if self.flat:
            return FlatKnapsack(self.sizes, self._caps(targets), self.num_nodes, self.need).values() >= self.microbatches
        best, _, _ = self._knapsack(targets)
        return (best[self.num_nodes][:, self.finals] >= self.microbatches).any(axis=1)

    def sizes_for(self, target: float) -> list[int]:
        """Pipeline sizes reaching `target`, with the fewest pipelines among equals."""
        if self.flat:
            flat = FlatKnapsack(self.sizes, self._caps(np.array([target])), self.num_nodes, self.need)
            if flat.values()[0] >= self.microbatches:
                return flat.sizes_for(0)
            raise AssertionError(f"target {target} is not reachable")
        best, choice, came_from = self._knapsack(np.array([target]))
        for p in self.finals:
            if best[self.num_nodes, 0, p] >= self.microbatches:
                return self._unwind(choice[:, 0], came_from[:, 0], p)
        raise AssertionError(f"target {target} is not reachable")

    @property
    def finals(self) -> list[int]:
        """Pipeline-count states that satisfy f + 1 <= P <= M."""
        return [self.pdim - 1] if self.capped else list(range(self.need, self.pdim))

    def caps_at(self, target: float) -> np.ndarray:
        """caps[t]: the most microbatches template t takes within `target`."""
        return self._caps(np.array([target]))[:, 0]

    def _caps(self, targets: np.ndarray) -> np.ndarray:
        """caps[t, q]: the most microbatches template t takes within targets[q] (0 to M)."""
        limit = targets * (1 + _EPS) + _EPS * self.bottleneck.max(initial=0.0)
        return np.stack([np.searchsorted(row, limit, side="right") for row in self.times]).astype(np.int64)

    def _knapsack(self, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """best[v, q, p]: most microbatches P pipelines on exactly v nodes can take in targets[q]."""
        q_count, n_total, pdim = len(targets), self.num_nodes, self.pdim
        caps = self._caps(targets)
        best = np.full((n_total + 1, q_count, pdim), -1, dtype=np.int64)  # -1: impossible
        choice = np.full((n_total + 1, q_count, pdim), -1, dtype=np.int64)
        came_from = np.full((n_total + 1, q_count, pdim), -1, dtype=np.int64)
        best[0, :, 0] = 0
        origin_row = np.arange(pdim) - 1  # state p comes from p - 1 ...
        for v in range(1, n_total + 1):
            fit = np.flatnonzero(self.sizes <= v)
            if fit.size == 0:
                continue
            prev = best[v - self.sizes[fit]]  # (templates, Q, pdim)
            shifted = np.full_like(prev, -1)
            shifted[..., 1:] = prev[..., :-1]
            origin = np.broadcast_to(origin_row, prev.shape).copy()
            if self.capped:  # ... and the capped state "at least need" also from itself
                stay = prev[..., -1] > prev[..., -2]
                shifted[..., -1] = np.where(stay, prev[..., -1], prev[..., -2])
                origin[..., -1] = np.where(stay, pdim - 1, pdim - 2)
            cap = caps[fit][:, :, None]
            value = np.where((shifted >= 0) & (cap >= 1), shifted + cap, -1)
            pick = value.argmax(axis=0)[None]  # (1, Q, pdim)
            best[v] = np.take_along_axis(value, pick, axis=0)[0]
            choice[v] = fit[pick[0]]
            came_from[v] = np.take_along_axis(origin, pick, axis=0)[0]
        return best, choice, came_from

    def _unwind(self, choice: np.ndarray, came_from: np.ndarray, p: int) -> list[int]:
        out = []
        v = self.num_nodes
        while v > 0:
            assert choice[v, p] >= 0, "unwinding an unreachable state"
            size = int(self.sizes[choice[v, p]])
            out.append(size)
            v, p = v - size, int(came_from[v, p])
        return out
