"""The instantiation knapsack when the pipeline count binds: fewer microbatches than N / n0.

Every pipeline needs a microbatch of its own, so with M < N / n0 some covers of the N nodes have
more pipelines than microbatches and the count P must be tracked: best(v, p) is the most
microbatches p pipelines covering exactly v nodes take within a target time, and a target is
reachable iff best(N, p) >= M for some f + 1 <= p <= M. `_SizeSearch._knapsack` fills that table
for every v, p and target at once (N x M x templates x targets: seconds per re-plan at 2048
nodes). Three things make it cheap here:

- **Layers by pipeline count.** best(., p) = max_n best(. - n, p - 1) + cap_n is one vectorised
  step over all node counts (a sliding window over the template sizes), for one target. It stops
  at the first p >= f + 1 that reaches M on N nodes: the pipeline count the plan takes (the
  fewest among those reaching the target), so a feasible target often costs few layers.
- **A relaxation first.** Feasibility only grows with the target (every cap does). The linear
  relaxation (real pipeline counts per template) is solved in closed form, its optimum using at
  most two templates, and rules targets out in microseconds; the exact layers start at the
  least target it allows and gallop up from there, so a plan runs a handful of them.
- **The same answer.** The multiset is unwound from the layers as `_knapsack`'s table would
  be: at (v, p), the first (smallest) template of the largest best(v - n, p - 1) + cap_n. The
  layers hold the same numbers as that table, so the plan is the same, tie for tie.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

_NONE = np.int64(-(1 << 40))
"""best(v, p) when no p pipelines cover exactly v nodes (far below any sum of caps)."""
_REL = 1e-9
"""Slack of the relaxation's float arithmetic, always on the side of "maybe reachable"."""


@dataclass(frozen=True, kw_only=True)
class Counted:
    """One instantiation whose pipeline count is bounded by the microbatches."""

    sizes: np.ndarray
    """Template node counts, ascending (int64)."""
    num_nodes: int
    """N: nodes to cover exactly."""
    need: int
    """f + 1: the fewest pipelines."""
    microbatches: int
    """M: the microbatches to place, and the most pipelines (one microbatch each at least)."""


def relaxation_allows(problem: Counted, caps: np.ndarray) -> bool:
    """False only if no real x_n >= 0 with sum x_n n = N, f + 1 <= sum x_n <= M has
    sum x_n cap_n >= M: then no integer multiset reaches the target either. `caps[t]`: the
    microbatches template t takes within the target (0: unusable)."""
    usable = caps >= 1
    if not usable.any():
        return False
    s = problem.sizes[usable].astype(np.float64)
    c = caps[usable].astype(np.float64)
    n, need, m = float(problem.num_nodes), float(problem.need), float(problem.microbatches)
    # An optimal vertex has at most two templates: one alone with the count free, or two with
    # the count at one of its bounds.
    count = n / s
    alone = (count >= need * (1 - _REL)) & (count <= m * (1 + _REL))
    best = float((count * c)[alone].max(initial=-np.inf))
    gap = s[None, :] - s[:, None]  # (a, b): s_b - s_a
    wider = gap > 0
    for pipes in (need, m):
        x_b = (n - pipes * s[:, None]) / np.where(wider, gap, 1.0)
        x_a = pipes - x_b
        fits = wider & (x_a >= -_REL * pipes) & (x_b >= -_REL * pipes)
        value = x_a * c[:, None] + x_b * c[None, :]
        best = max(best, float(value[fits].max(initial=-np.inf)))
    return best >= m * (1 - _REL) - _REL


class Layers:
    """best(., p) for p = 0, 1, ... up to the first p >= f + 1 with best(N, p) >= M, if any.

    Every layer is kept for the unwinding: (p + 1) x (N + 1) integers, 8 MB at 2,048 nodes and
    512 pipelines; the time is p vectorised steps of N x (largest - smallest template) each."""

    def __init__(self, problem: Counted, caps: np.ndarray) -> None:
        """`caps[t]`: the microbatches template t takes within the target (0: unusable)."""
        self.problem = problem
        self.caps = caps.astype(np.int64)
        first = np.full(problem.num_nodes + 1, _NONE, dtype=np.int64)
        first[0] = 0
        self.rows = [first]
        self.reached: int | None = None
        """The fewest pipelines (>= f + 1) taking M microbatches on N nodes; None: the target is
        out of reach."""
        usable = np.flatnonzero(self.caps >= 1)
        if usable.size:
            self._fill(usable)

    def _fill(self, usable: np.ndarray) -> None:
        pr = self.problem
        n_total, sizes = pr.num_nodes, pr.sizes
        s_lo, s_hi = int(sizes[usable].min()), int(sizes[usable].max())
        add = np.full(s_hi - s_lo + 1, _NONE, dtype=np.int64)  # add[j]: cap of size s_hi - j
        add[s_hi - sizes[usable]] = self.caps[usable]
        pad = np.full(s_hi, _NONE, dtype=np.int64)
        for p in range(1, pr.microbatches + 1):
            lo, hi = p * s_lo, min(n_total, p * s_hi)  # the v that p pipelines can cover
            if lo > n_total:
                break
            # window[v, j] = best(v - (s_hi - j), p - 1): every template's predecessor of v.
            window = np.lib.stride_tricks.sliding_window_view(np.concatenate([pad, self.rows[-1]]), add.size)
            row = np.full(n_total + 1, _NONE, dtype=np.int64)
            row[lo : hi + 1] = np.maximum((window[lo : hi + 1] + add).max(axis=1), _NONE)
            self.rows.append(row)
            if p >= pr.need and row[n_total] >= pr.microbatches:
                self.reached = p
                return

    def sizes(self) -> list[int]:
        """The multiset (node counts, in unwinding order) reaching the target with `reached`
        pipelines, picked as `_SizeSearch._knapsack` picks it."""
        assert self.reached is not None, "unwinding an unreachable target"
        sizes, caps = self.problem.sizes, self.caps
        out: list[int] = []
        v, p = self.problem.num_nodes, self.reached
        while v > 0:
            src = v - sizes
            fit = (src >= 0) & (caps >= 1)
            prev = self.rows[p - 1][np.where(fit, src, 0)]
            value = np.where(fit & (prev >= 0), prev + caps, -1)
            t = int(value.argmax())  # the first template among equals
            assert value[t] >= 0, "unwinding an unreachable state"
            out.append(int(sizes[t]))
            v, p = v - int(sizes[t]), p - 1
        assert p == 0, "the unwinding must use every layer"
        return out


def least_target(problem: Counted, candidates: np.ndarray, caps_at: Callable[[float], np.ndarray]) -> Layers | None:
    """The layers of the least reachable target in `candidates` (ascending), None if none is.
    `caps_at(target)`: each template's cap within it."""
    top = len(candidates) - 1
    if top < 0 or not relaxation_allows(problem, caps_at(float(candidates[top]))):
        return None
    lo, hi = 0, top  # the relaxation rules out candidates below lo
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if relaxation_allows(problem, caps_at(float(candidates[mid]))) else (mid + 1, hi)
    # Gallop up from the first candidate the relaxation allows, then bisect the last step.
    below, at, step = lo - 1, lo, 1
    while True:
        layers = Layers(problem, caps_at(float(candidates[at])))
        if layers.reached is not None:
            break
        if at == top:
            return None
        below, at, step = at, min(top, at + step), 2 * step
    lo, hi = below + 1, at  # candidates[below] is out of reach, candidates[at] within it
    while lo < hi:
        mid = (lo + hi) // 2
        trial = Layers(problem, caps_at(float(candidates[mid])))
        if trial.reached is not None:
            hi, layers = mid, trial
        else:
            lo = mid + 1
    return layers
