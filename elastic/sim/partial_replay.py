"""Partial replay in the planner's cost model: what a failure mid-step costs today's runtime.

The runtime (elastic/records/partial.py) keeps the microbatches of every pipeline that lost no
node: if the failure comes at least `finish_from` (1/3) into the step, those pipelines finish
their microbatches while the loss is detected, and the next generation's first step computes
only the lost pipelines' microbatches, spread over its pipelines in proportion to each one's
share of the global batch (`Plan.spread`, as `elastic.records.partial.split_microbatches` does);
earlier in the step, every pipeline stops and the whole step is replayed. Committed work is never
lost either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from elastic.sim.slowness import slow_stage_times
from templates.cost import pipeline_time
from templates.plan import Plan
from templates.template_set import TemplateSet


def lost_microbatches(plan: Plan, nodes: set[int]) -> int:
    """Microbatches of the step held by `plan`'s pipelines that have a node in `nodes`."""
    return sum(pipe.microbatches for pipe in plan.pipelines if any(n in nodes for n in pipe.nodes))


def replay_s(tset: TemplateSet, plan: Plan, factors: Mapping[int, float], count: int) -> float:
    """Seconds `plan` takes to compute `count` microbatches spread as the runtime does (each
    pipeline's 1F1B time over its stage times, slow nodes' factors included; idle ones 0)."""
    times = slow_stage_times(tset, plan, factors)
    return max((pipeline_time([times[st.node] for st in pipe.stages], m, pipe.virtual_stages)
                for pipe, m in zip(plan.pipelines, plan.spread(count), strict=True) if m > 0), default=0.0)


@dataclass(frozen=True, kw_only=True)
class Cut:
    """How a failure `fraction` into the in-flight step treats that step."""

    finish: bool
    """True: the intact pipelines finish and only the lost microbatches are replayed; False:
    every pipeline stops and the whole step is replayed."""
    wait_s: float
    """Seconds from the failure until the leader re-plans: detection, or the intact pipelines
    finishing if that takes longer (they report their kept sums first)."""


def cut(fraction: float, step_s: float, *, detect_s: float, finish_from: float, partial: bool) -> Cut:
    """The runtime's choice for a failure `fraction` (0 <= fraction < 1) into a step of `step_s`."""
    if partial and fraction >= finish_from:
        return Cut(finish=True, wait_s=max(detect_s, (1.0 - fraction) * step_s))
    return Cut(finish=False, wait_s=detect_s)
