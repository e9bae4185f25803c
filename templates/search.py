"""Exact search for pipeline templates: the best stage layout for each node count.

For n nodes (n stages) and m microbatches the objective is
    sum_s t_s + (m - 1) * max_s t_s,
with t_s the cost of stage s (which depends on its layer range and on its distance k from the
end of the pipeline, see `templates.cost`). It is not decomposable, so keeping one best
sub-layout per (layer suffix, stages) subproblem, as the published Oobleck planner does, can
miss the optimum. This search is exact:

1. For a bottleneck bound B, a DP over (layer suffix i, stages k) gives the least sum of stage
   times over layouts whose every stage costs <= B, for all k at once.
2. The optimum with bottleneck M* is found at B = M*, where that DP returns a layout of sum
   <= the optimum's sum and max <= M*. So minimising  minsum(B) + (m - 1) * B  over the finite
   set of possible stage times B is exact.
3. Only B in [min-max bottleneck of n stages, (best - unconstrained min sum) / (m - 1)] can
   improve on the best found, which keeps the scan short; B values are evaluated in numpy
   batches, for all node counts together.

Ties are broken deterministically: the smallest B first, then the smallest cut index.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from templates.cost import StageCosts, pipeline_time

_BATCH = 32
_REL_EPS = 1e-12


@dataclass(frozen=True, kw_only=True)
class PipelineTemplate:
    """The best layout found for a pipeline of exactly `num_nodes` nodes."""

    num_nodes: int
    """Nodes (= stages) of the pipeline."""
    stages: tuple[tuple[int, int], ...]
    """Layer range [first, last+1) of each stage, in pipeline order."""
    stage_times: tuple[float, ...]
    """Cost of each stage per microbatch (seconds), position terms included."""
    microbatches: int
    """The microbatch count the layout was optimised for."""
    recompute: tuple[str, ...] = ()
    """What each stage's backward recomputes (`templates.cost`); empty: "none" everywhere."""
    chunks: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Interleaved (templates/interleave.py): each stage's chunk ranges, chunk 0 being its
    `stages` entry; empty: one chunk per stage (v = 1)."""

    plain_stage_times: tuple[float, ...] = ()
    """Interleaved: the stage times of the same template at v = 1 (what `plain_time_for`
    compares against); empty: `stage_times`."""
    _times: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)
    """`time_for` per microbatch count asked so far."""

    @property
    def virtual_stages(self) -> int:
        """v: model chunks per node."""
        return len(self.chunks[0]) if self.chunks else 1

    def plain_time_for(self, microbatches: int) -> float:
        """The 1F1B time of the template before interleaving, for `microbatches`."""
        return pipeline_time(self.plain_stage_times or self.stage_times, microbatches)

    @cached_property
    def layout(self) -> tuple[tuple[tuple[int, int], str, tuple[tuple[int, int], ...]], ...]:
        """(layers, recompute, chunks) of each stage, as `templates.plan.PipelinePlan.layout`
        reads a pipeline built from it (computed once)."""
        return tuple(zip(self.stages, self.stage_modes, self.chunks or ((),) * self.num_nodes, strict=True))

    @property
    def stage_modes(self) -> tuple[str, ...]:
        """The recomputation mode of each stage."""
        return self.recompute or ("none",) * len(self.stages)

    @property
    def bottleneck(self) -> float:
        return max(self.stage_times)

    @property
    def iteration_time(self) -> float:
        """1F1B time for `microbatches` microbatches."""
        return self.time_for(self.microbatches)

    def time_for(self, microbatches: int) -> float:
        """1F1B time of this layout for `microbatches` microbatches (interleaved 1F1B with v > 1);
        remembered, as every split and re-plan asks the same few counts of the same templates."""
        seconds = self._times.get(microbatches)
        if seconds is None:
            seconds = self._times[microbatches] = pipeline_time(self.stage_times, microbatches, self.virtual_stages)
        return seconds

    def to_dict(self) -> dict[str, object]:
        return {
            "nodes": self.num_nodes,
            "stages": [{"layers": [first, last], "recompute": mode}
                       | ({"chunks": [list(r) for r in self.chunks[s]]} if self.chunks else {})
                       for s, ((first, last), mode) in enumerate(zip(self.stages, self.stage_modes, strict=True))],
            "virtual_stages": self.virtual_stages,
            "plain_iteration_time": self.plain_time_for(self.microbatches),
            "stage_times": list(self.stage_times),
            "microbatches": self.microbatches,
            "iteration_time": self.iteration_time,
        }


def search_templates(costs: StageCosts, microbatches: Mapping[int, int]) -> dict[int, PipelineTemplate]:
    """Exact best template for every node count in `microbatches` (n -> m); infeasible n are absent."""
    counts = sorted(microbatches)
    if not counts:
        return {}
    if counts[0] < 1:
        raise ValueError(f"node counts must be >= 1, got {counts[0]}")
    for n in counts:
        if microbatches[n] < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches[n]} for {n} nodes")
    num_layers = costs.num_layers
    k_max = min(counts[-1], num_layers)
    cost_k = [np.empty(0)] + [costs.costs(k) for k in range(1, k_max + 1)]

    minmax = _minmax_dp(cost_k, k_max)
    free_sum, free_max = _minsum_free_dp(cost_k, k_max)

    best: dict[int, float] = {}
    best_bound: dict[int, float] = {}
    lower: dict[int, float] = {}
    for n in counts:
        if n > k_max or not np.isfinite(minmax[n]):
            continue
        m = microbatches[n]
        best[n] = free_sum[n] + (m - 1) * free_max[n]
        best_bound[n] = np.inf  # the unconstrained layout
        lower[n] = minmax[n]

    def upper(n: int) -> float:
        m = microbatches[n]
        if m == 1:
            return -np.inf  # the unconstrained min-sum layout is optimal
        return (best[n] - free_sum[n]) / (m - 1)

    candidates = costs.candidate_times()
    while best:
        # Only bounds inside some node count's open window [lower, upper] can still improve it.
        open_counts = [n for n in best if upper(n) * (1 + _REL_EPS) >= lower[n] * (1 - _REL_EPS)]
        if not open_counts:
            break
        lo = np.array([lower[n] for n in open_counts]) * (1 - _REL_EPS)
        hi = np.array([upper(n) for n in open_counts]) * (1 + _REL_EPS)
        inside = (candidates[:, None] >= lo[None, :]) & (candidates[:, None] <= hi[None, :])
        wanted = np.flatnonzero(inside.any(axis=1))
        if wanted.size == 0:
            break
        take = wanted[:_BATCH]
        batch = candidates[take]
        users = [n for c, n in enumerate(open_counts) if inside[take, c].any()]
        candidates = candidates[take[-1] + 1 :]
        sums = _minsum_dp(cost_k, max(users), batch)  # (k + 1, len(batch)) sums from layer 0
        for n in users:
            m = microbatches[n]
            for b, bound in enumerate(batch):
                if bound < lower[n] * (1 - _REL_EPS):
                    continue
                value = sums[n, b] + (m - 1) * bound
                if value < best[n] * (1 - _REL_EPS):
                    best[n] = value
                    best_bound[n] = float(bound)

    templates: dict[int, PipelineTemplate] = {}
    for n in sorted(best):
        bounds = _reconstruct(cost_k, n, best_bound[n])
        times = costs.layout_times(bounds)
        assert times is not None, "the DP returned a layout that does not fit memory"
        templates[n] = PipelineTemplate(
            num_nodes=n, stages=tuple(bounds), stage_times=tuple(times), microbatches=microbatches[n],
            recompute=costs.layout_modes(bounds),
        )
    return templates


def _minmax_dp(cost_k: list[np.ndarray], k_max: int) -> np.ndarray:
    """For each k, the least possible bottleneck of a k-stage layout of all layers (inf if none)."""
    out = np.full(k_max + 1, np.inf)
    suffix = cost_k[1][:, -1].copy()  # one stage holding [i, L)
    out[1] = suffix[0]
    for k in range(2, k_max + 1):
        suffix = np.maximum(cost_k[k], suffix[None, :]).min(axis=1)
        out[k] = suffix[0]
    return out


def _minsum_free_dp(cost_k: list[np.ndarray], k_max: int) -> tuple[np.ndarray, np.ndarray]:
    """Least sum of stage times for each k without a bottleneck bound, and that layout's max."""
    sums = np.full(k_max + 1, np.inf)
    maxes = np.full(k_max + 1, np.inf)
    suffix = cost_k[1][:, -1].copy()
    suffix_max = suffix.copy()
    sums[1], maxes[1] = suffix[0], suffix_max[0]
    for k in range(2, k_max + 1):
        total = cost_k[k] + suffix[None, :]
        cut = np.argmin(total, axis=1)
        rows = np.arange(total.shape[0])
        suffix_max = np.maximum(cost_k[k][rows, cut], suffix_max[cut])
        suffix = total[rows, cut]
        sums[k], maxes[k] = suffix[0], suffix_max[0]
    return sums, maxes


def _minsum_dp(cost_k: list[np.ndarray], k_max: int, bounds: np.ndarray) -> np.ndarray:
    """(k_max + 1, len(bounds)): least sum of a k-stage layout with every stage <= bound."""
    slack = bounds * (1 + _REL_EPS)
    out = np.full((k_max + 1, len(bounds)), np.inf)
    last = cost_k[1][:, -1]
    suffix = np.where(last[None, :] <= slack[:, None], last[None, :], np.inf)  # (B, L+1)
    out[1] = suffix[:, 0]
    for k in range(2, k_max + 1):
        c = cost_k[k]
        masked = np.where(c[None, :, :] <= slack[:, None, None], c[None, :, :], np.inf)
        suffix = (masked + suffix[:, None, :]).min(axis=2)
        out[k] = suffix[:, 0]
    return out


def _reconstruct(cost_k: list[np.ndarray], n: int, bound: float) -> list[tuple[int, int]]:
    """The least-sum n-stage layout with every stage <= bound (smallest cut first on ties)."""
    slack = bound * (1 + _REL_EPS)
    cuts: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * (n + 1)
    last = cost_k[1][:, -1]
    suffix = np.where(last <= slack, last, np.inf)
    for k in range(2, n + 1):
        c = cost_k[k]
        total = np.where(c <= slack, c, np.inf) + suffix[None, :]
        cuts[k] = np.argmin(total, axis=1)
        suffix = total[np.arange(total.shape[0]), cuts[k]]
    assert np.isfinite(suffix[0]) or n == 1, "no layout under the chosen bound"
    bounds = []
    first = 0
    for k in range(n, 1, -1):
        nxt = int(cuts[k][first])
        bounds.append((first, nxt))
        first = nxt
    bounds.append((first, cost_k[1].shape[0] - 1))
    return bounds


def feasible_stage_counts(costs: StageCosts, k_max: int) -> list[int]:
    """Stage counts k <= k_max for which some k-stage layout fits memory, ascending."""
    k_max = min(k_max, costs.num_layers)
    if k_max < 1:
        return []
    cost_k = [np.empty(0)] + [costs.costs(k) for k in range(1, k_max + 1)]
    minmax = _minmax_dp(cost_k, k_max)
    return [k for k in range(1, k_max + 1) if np.isfinite(minmax[k])]
