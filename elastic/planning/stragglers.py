"""Straggler detection: per-node speed factors from the busy time of each committed step, and a
mark with hysteresis (issue 33: measure and detect).

What is measured: a node's *busy* seconds of a step, the wall time of its forward and backward
schedule less the time it waited on peers (elastic/engine/step.py), which the step's vote carries
to every worker (elastic/parallel/grad_sync.py). Waiting is left out, so a slow node's pipeline
mates, which wait for it, do not look slow themselves.

From busy seconds to a speed factor, per step:

- the work of a node is its stage's layers times its pipeline's microbatches, and its cost per
  unit of work is busy / work;
- its peers are the nodes in the same position of their pipelines (a whole pipeline, a first, a
  middle or a last stage: the embedding and the head cost extra in the first and last), other
  than itself; with none, every other node;
- its factor is its cost over the median cost of its peers (1.0 when no peer has a cost).

A node is a straggler once the median of its last `window` factors is at least `threshold` for
`steps` consecutive steps, and stops being one once that median is below `clear_below` for
`steps` consecutive steps: between the two thresholds nothing changes (hysteresis), and a spike
shorter than about half the window moves no median. The tracker keeps O(window) numbers per node
and does O(nodes log nodes) work per step.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from templates.plan import Plan

Position = Literal["whole", "first", "middle", "last"]
"""Where a stage sits in its pipeline (peers share it)."""

POLICIES = ("off", "report")
"""What the runtime does about stragglers: `off` keeps no factors and marks none; `report` marks
them in `status` and `events` and leaves the plan as it is. (Acting on them, `rebalance` and
`auto`, is issue 33's next part.)"""


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """When a node counts as a straggler (module doc)."""

    policy: str = "report"
    threshold: float = 1.25
    """A node whose smoothed factor is at least this is slow."""
    steps: int = 10
    """Consecutive slow steps that mark a node; consecutive fast steps that clear the mark."""
    clear_below: float | None = None
    """A marked node's smoothed factor must fall below this to count as recovered (default:
    halfway between 1 and `threshold`)."""
    window: int = 5
    """Steps whose median factor is the smoothed factor."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"straggler policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.threshold > 1.0:
            raise ValueError(f"straggler threshold must be above 1.0 (a factor against peers), got {self.threshold}")
        if self.steps < 1:
            raise ValueError(f"straggler steps must be at least 1, got {self.steps}")
        if self.window < 1:
            raise ValueError(f"straggler window must be at least 1, got {self.window}")
        if self.clear_below is not None and not 1.0 <= self.clear_below <= self.threshold:
            raise ValueError(f"straggler clear_below must be in [1, threshold={self.threshold}], got {self.clear_below}")

    @property
    def recovered_below(self) -> float:
        return self.clear_below if self.clear_below is not None else 1.0 + (self.threshold - 1.0) / 2


@dataclass(frozen=True, kw_only=True)
class NodeWork:
    """What one node does in a step of a plan."""

    work: float
    """Its stage's layers times its pipeline's microbatches."""
    position: Position


def node_work(plan: Plan) -> dict[int, NodeWork]:
    """Every node's work and position in `plan`."""
    out: dict[int, NodeWork] = {}
    for pipe in plan.pipelines:
        last = len(pipe.stages) - 1
        for s, stage in enumerate(pipe.stages):
            position: Position = "whole" if last == 0 else "first" if s == 0 else "last" if s == last else "middle"
            layers = stage.layers[1] - stage.layers[0]
            out[stage.node] = NodeWork(work=float(max(layers, 1) * pipe.microbatches), position=position)
    return out


def _median_without(ordered: list[float], i: int) -> float:
    """The median of sorted `ordered` without its element at index `i` (at least two elements)."""
    m = len(ordered) - 1
    lo, hi = (m - 1) // 2, m // 2
    at = [j if j < i else j + 1 for j in (lo, hi)]
    return (ordered[at[0]] + ordered[at[1]]) / 2


def speed_factors(busy: Mapping[int, float], work: Mapping[int, NodeWork]) -> dict[int, float]:
    """Each node's cost per unit of work over the median of its peers' (module doc): one sort per
    position, so O(nodes log nodes) a step."""
    cost = {n: busy[n] / w.work for n, w in work.items() if n in busy and busy[n] > 0 and w.work > 0}
    groups: dict[str, list[tuple[float, int]]] = {}
    for n, c in cost.items():
        groups.setdefault(work[n].position, []).append((c, n))
    everyone = sorted((c, n) for n, c in cost.items())
    out: dict[int, float] = {}
    for members in [*groups.values(), everyone]:
        members.sort()
        ordered = [c for c, _ in members]
        for i, (c, n) in enumerate(members):
            if n in out or (len(members) < 2):
                continue  # a node's own position decides first; `everyone` serves the lone ones
            out[n] = c / _median_without(ordered, i)
    return {n: out.get(n, 1.0) for n in cost}


@dataclass
class _NodeState:
    factors: deque[float]
    busy: deque[float]
    slow_run: int = 0
    fast_run: int = 0


@dataclass(frozen=True, kw_only=True)
class Change:
    """A node became a straggler (`marked`) or stopped being one."""

    node: int
    marked: bool
    step: int
    factor: float
    """The smoothed factor at the change."""


@dataclass
class SpeedTracker:
    """Smoothed speed factors and straggler marks over the steps observed (module doc)."""

    config: StragglerConfig
    marked: dict[int, int] = field(default_factory=dict)
    """Straggler node -> the step at which it was marked."""
    _nodes: dict[int, _NodeState] = field(default_factory=dict)

    def observe(self, step: int, busy: Mapping[int, float], work: Mapping[int, NodeWork]) -> list[Change]:
        """Take in one committed step's busy seconds per node; the marks it changed."""
        changes: list[Change] = []
        factors = speed_factors(busy, work)
        for node in list(self._nodes):
            if node not in work:  # left the plan: its history and mark go with it
                del self._nodes[node]
                if self.marked.pop(node, None) is not None:
                    changes.append(Change(node=node, marked=False, step=step, factor=float("nan")))
        for node, factor in factors.items():
            window = self.config.window
            state = self._nodes.setdefault(node, _NodeState(factors=deque(maxlen=window), busy=deque(maxlen=window)))
            state.factors.append(factor)
            state.busy.append(busy[node])
            smooth = statistics.median(state.factors)
            state.slow_run = state.slow_run + 1 if smooth >= self.config.threshold else 0
            state.fast_run = state.fast_run + 1 if smooth < self.config.recovered_below else 0
            if node not in self.marked and state.slow_run >= self.config.steps:
                self.marked[node] = step
                changes.append(Change(node=node, marked=True, step=step, factor=smooth))
            elif node in self.marked and state.fast_run >= self.config.steps:
                del self.marked[node]
                changes.append(Change(node=node, marked=False, step=step, factor=smooth))
        return changes

    def smoothed(self) -> dict[int, float]:
        """Every node's current smoothed factor."""
        return {n: statistics.median(s.factors) for n, s in self._nodes.items() if s.factors}

    def busy_seconds(self) -> dict[int, float]:
        """Every node's busy seconds a step, the median of the same window."""
        return {n: statistics.median(s.busy) for n, s in self._nodes.items() if s.busy}
