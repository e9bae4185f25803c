"""Straggler detection: per-node speed factors from the busy time of each committed step, and a
mark with hysteresis (issue 33: measure and detect).

What is measured: a node's *busy* seconds of a step, the seconds of its forward and backward
passes on the device's own clock (elastic/parallel/phase_clock.py: timing events on an
accelerator; on the CPU, wall time less the time the thread waited for a core), which the step's
vote carries to every worker with its wait on peers (elastic/parallel/grad_sync.py). Waiting is
left out, so a slow node's pipeline mates, which wait for it, do not look slow themselves.

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

import dataclasses
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from templates.cost import pipeline_time
from templates.instantiation import split_microbatches
from templates.plan import Plan
from templates.template_set import PlanningError, TemplateSet

Position = Literal["whole", "first", "middle", "last"]
"""Where a stage sits in its pipeline (peers share it)."""

POLICIES = ("off", "report", "rebalance", "auto")
"""What the runtime does about stragglers: `off` keeps no factors and marks none; `report` marks
them in `status` and `events` and leaves the plan as it is; `rebalance` also re-splits the global
batch at the next step boundary, fewer microbatches for a straggler's pipeline (`rebalanced`),
and back when the mark clears; `auto` weighs that against a hot spare in the straggler's stage
and against dropping it, and takes the cheapest estimate (straggler_options.py)."""
ACTING = ("rebalance", "auto")
"""The policies under which the leader changes the plan for stragglers."""


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """When a node counts as a straggler (module doc)."""

    policy: str = "auto"
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
            layers = len(stage.held)
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
        """Every node's busy seconds a step, the median of a full window since `new_plan`."""
        return {n: statistics.median(s.busy) for n, s in self._nodes.items() if len(s.busy) == self.config.window}

    def new_plan(self) -> None:
        """A new generation: its busy seconds are not comparable with the last plan's (another
        split), so they start again; the factors, normalised by each step's work, go on."""
        for state in self._nodes.values():
            state.busy.clear()


# ---- acting: rebalance -------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Rebalance:
    """A re-split of the global batch for the stages' times, and its estimates."""

    plan: Plan
    """The same pipelines and stages with the new microbatch counts."""
    step_s: float
    """Estimated step time of `plan` (1F1B over the stage times, the planner's cost model)."""
    unchanged_s: float
    """Estimated step time of the current split with the same stage times (doing nothing)."""


def measured_stage_times(plan: Plan, busy: Mapping[int, float]) -> dict[int, float]:
    """Each node's seconds a microbatch, from its busy seconds a step under `plan` (a straggler's
    slowness included); nodes without a measure are left out."""
    return {s.node: busy[s.node] / pipe.microbatches for pipe in plan.pipelines for s in pipe.stages
            if busy.get(s.node, 0.0) > 0 and pipe.microbatches > 0}


def template_stage_times(tset: TemplateSet, plan: Plan) -> dict[int, float]:
    """Each node's seconds a microbatch in the planner's cost model (its pipeline's template; 1.0
    for every stage of a pipeline whose layers are not its template's)."""
    out: dict[int, float] = {}
    for pipe in plan.pipelines:
        try:
            template = tset.serving(plan).template(len(pipe.stages))
            same = tuple(s.ranges for s in pipe.stages) == (template.chunks or tuple((r,) for r in template.stages))
            times = list(template.stage_times) if same else []
        except PlanningError:  # no template of that size
            times = []
        out.update({s.node: times[i] if times else 1.0 for i, s in enumerate(pipe.stages)})
    return out


def planner_split(tset: TemplateSet, plan: Plan) -> Plan:
    """`plan` with the planner's own microbatch split (its templates' stage times)."""
    return rebalanced(plan, template_stage_times(tset, plan)).plan


def rebalanced(plan: Plan, stage_times: Mapping[int, float]) -> Rebalance:
    """`plan` with its global microbatches re-split for `stage_times` (node -> seconds a
    microbatch; the median of the others where one is missing): the split minimises the slowest
    pipeline's 1F1B time, as the planner's own split does (templates/instantiation.py), so the
    planner's stage times give the planner's split back. Nothing but the microbatch counts
    changes: the nodes, stages and layers stay, and so do the global batch and what a step
    computes (every split sums the same microbatches in the same tree)."""
    known = [t for t in stage_times.values() if t > 0]
    default = statistics.median(known) if known else 1.0
    times = [[stage_times.get(s.node, default) for s in pipe.stages] for pipe in plan.pipelines]
    chunks = [pipe.virtual_stages for pipe in plan.pipelines]
    counts = split_microbatches([_Timed(t, v) for t, v in zip(times, chunks, strict=True)], plan.global_microbatches)
    pipelines = tuple(dataclasses.replace(pipe, microbatches=count,
                                          iteration_time=pipeline_time(t, count, pipe.virtual_stages))
                      for pipe, t, count in zip(plan.pipelines, times, counts, strict=True))
    new = dataclasses.replace(plan, pipelines=pipelines, iteration_time=max(p.iteration_time for p in pipelines))
    unchanged = max(pipeline_time(t, pipe.microbatches, pipe.virtual_stages)
                    for pipe, t in zip(plan.pipelines, times, strict=True))
    return Rebalance(plan=new, step_s=new.iteration_time, unchanged_s=unchanged)


@dataclass(frozen=True)
class _Timed:
    """A pipeline's 1F1B time (interleaved over `chunks`) for m microbatches, as
    `split_microbatches` asks it."""

    stage_times: list[float]
    chunks: int = 1

    def time_for(self, microbatches: int) -> float:
        return pipeline_time(self.stage_times, microbatches, self.chunks)
