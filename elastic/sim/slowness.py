"""Slow nodes in the planner's cost model, shared by every policy.

A node slowed by a factor F takes F times its stage's cost-model time per microbatch (its
pipeline's template stage times, `elastic.planning.stragglers.template_stage_times`); a pipeline
runs at its 1F1B time over those stage times (`templates.cost.pipeline_time`, the planner's own
formula), and a step takes the slowest pipeline's time, since the global batch waits for every
pipeline. With every node at full speed this is exactly the plan's `iteration_time`.
"""

from __future__ import annotations

from collections.abc import Mapping

from elastic.planning.stragglers import Rebalance, rebalanced, template_stage_times
from templates.cost import pipeline_time
from templates.plan import Plan
from templates.template_set import TemplateSet

STRAGGLER_POLICIES = ("off", "rebalance", "auto")
"""What the elastic policy does about a slow node (`elastic simulate --straggler-policy`): `off`
nothing (the step runs at the slow pipeline's pace); `rebalance` re-splits the microbatches as the
runtime's `--straggler-policy rebalance` does; `auto` first weighs replacing the node by a free
hot spare (this simulation's rule, elastic/sim/elastic_run.py: spare or rebalance, nothing else)."""


def slow_stage_times(tset: TemplateSet, plan: Plan, factors: Mapping[int, float]) -> dict[int, float]:
    """Each node's seconds a microbatch in `plan`: the cost model's stage time x its factor."""
    return {node: t * factors.get(node, 1.0) for node, t in template_stage_times(tset, plan).items()}


def slow_step_s(tset: TemplateSet, plan: Plan, factors: Mapping[int, float]) -> float:
    """Seconds per step of `plan`, its own microbatch split kept, with the nodes of `factors`
    slowed (module doc): for a plan the planner split, exactly its `iteration_time` when none of
    them is in it (the same formula over the same template stage times)."""
    if not factors:
        return plan.iteration_time  # the same formula over the same stage times, without the walk
    times = slow_stage_times(tset, plan, factors)
    return max(pipeline_time([times[st.node] for st in pipe.stages], pipe.microbatches, pipe.virtual_stages)
               for pipe in plan.pipelines)


def resplit(tset: TemplateSet, plan: Plan, factors: Mapping[int, float]) -> Rebalance:
    """The runtime's re-split of `plan` for its slowed stage times (`rebalanced`): the global
    batch's microbatches re-divided so that the slowest pipeline's 1F1B time is least."""
    return rebalanced(plan, slow_stage_times(tset, plan, factors))


def same_split(a: Plan, b: Plan) -> bool:
    """Whether two plans over the same pipelines give each the same microbatches."""
    return [p.microbatches for p in a.pipelines] == [p.microbatches for p in b.pipelines]


def note_speed(factors: dict[int, float], node: int, factor: float | None) -> None:
    """Record a `slow` (a factor) or `recover` (None) event of `node` in `factors`."""
    if factor is not None:
        factors[node] = factor
    else:
        factors.pop(node, None)
