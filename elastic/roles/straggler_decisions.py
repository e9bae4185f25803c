"""The leader's straggler decision (issue 33: act), a pure function of what it read: the
generation record, the `stragglers` record, the settings in force and a ready spare.

- Under `off` and `report` nothing changes, except that a split made for stragglers goes back
  to the planner's (the policy was changed away from acting on a running job).
- Under `rebalance`, while a node is marked, the split follows the measured stage times, but only
  for an estimated gain of at least `gain` (noise moves no microbatch): away from a slow node, and
  back once its pipeline is as fast again, even before the mark clears (a pipeline left with few
  microbatches reads slower per microbatch, its fixed costs shared by fewer). Once no mark is
  left, the planner's split comes back.
- Under `auto`, for the slowest marked node, the options of elastic/planning/straggler_options.py
  are estimated (a ready spare in its stage, dropping it, rebalancing) and the cheapest is taken:
  a spare or a drop is a drain of the node (`DrainStraggler`, carried out by the leader's drain
  path), a rebalance is as above.

The measured times must be a full window of the current generation (the record's generation is
`g` and every plan node has a busy time): a plan just changed is not judged on the last one's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from elastic.planning.straggler_options import choose, straggler_options
from elastic.planning.stragglers import ACTING, measured_stage_times, planner_split, rebalanced
from elastic.records.generation import GenerationRecord
from elastic.records.stragglers import StragglerRecord
from templates.plan import Plan
from templates.template_set import TemplateSet


@dataclass(frozen=True, kw_only=True)
class Resplit:
    """Publish the same nodes and stages with another microbatch split."""

    plan: Plan
    reason: str
    balanced_for: list[int]
    """The marked nodes the split was made for (empty: the planner's split)."""


@dataclass(frozen=True, kw_only=True)
class DrainStraggler:
    """Drain `node` out of the job: a ready spare takes its stage (`choice` spare), or the others
    are re-planned (`choice` drop)."""

    node: int
    choice: str
    factor: float
    estimates: str
    """Every option's estimated step time (`Options.summary`)."""


Decision = Resplit | DrainStraggler | None


def straggler_decision(*, policy: str, g: int, record: GenerationRecord, speeds: StragglerRecord | None,
                       tset: TemplateSet, gain: float, spare_for: Callable[[int], int | None]) -> Decision:
    """What to do about stragglers at this round (module doc). `spare_for(node)`: a ready spare
    that would take `node`'s stage, or None (asked only under `auto`, for a marked node)."""
    plan = record.plan
    marked = sorted(n for n in (speeds.marked if speeds is not None else {}) if n in plan.nodes)
    if policy not in ACTING or not marked:
        if not record.balanced_for:
            return None
        back = planner_split(tset, plan)
        why = "no straggler left" if policy in ACTING else f"the straggler policy is now {policy}"
        return _resplit(plan, back, f"rebalance: {why}", "the planner's split", [])
    assert speeds is not None
    times = measured_stage_times(plan, speeds.busy)
    if speeds.generation != g or set(times) != set(plan.nodes):
        return None  # no full window of measures under this plan yet
    what = ", ".join(_speed_of(n, speeds) for n in marked)
    if policy == "auto":
        node = max(marked, key=lambda n: (speeds.marked[n].factor, -n))
        factor = speeds.factors.get(node, speeds.marked[node].factor)
        options = straggler_options(tset, plan, times, node=node, factor=factor, spare=spare_for(node))
        best = choose(options, gain=gain)
        if best is not None and best.kind != "rebalance":
            return DrainStraggler(node=node, choice=best.kind, factor=factor, estimates=options.summary())
        estimate = f"estimated step {options.summary()}"
    result = rebalanced(plan, times)
    if result.step_s > (1.0 - gain) * result.unchanged_s:
        return None
    if policy != "auto":
        estimate = f"estimated step {result.unchanged_s:.3f} s (doing nothing) -> {result.step_s:.3f} s"
    return _resplit(plan, result.plan, f"rebalance for straggler(s) {what}", estimate, marked)


def _speed_of(node: int, speeds: StragglerRecord) -> str:
    """`node N at F x`, and the factor it was marked at when that differs (a node that has
    recovered keeps its mark for K steps, while its pipeline is already given its share back)."""
    marked = speeds.marked[node].factor
    now = speeds.factors.get(node, marked)
    return f"node {node} at {marked:.2f}x" if abs(now - marked) < 0.05 * marked else (
        f"node {node} at {now:.2f}x now (marked at {marked:.2f}x)")


def _resplit(plan: Plan, new: Plan, why: str, estimate: str, marked: list[int]) -> Resplit | None:
    before, after = ([p.microbatches for p in x.pipelines] for x in (plan, new))
    if before == after:
        return None
    return Resplit(plan=new, reason=f"{why}: microbatches {before} -> {after}, {estimate}", balanced_for=marked)
