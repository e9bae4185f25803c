"""What the leader can do about a straggler under `--straggler-policy auto` (issue 33: act), with
each option's estimated step time, so that it takes the cheapest and logs them all.

For the slowest marked node S of a plan, with each node's measured seconds a microbatch
(`stragglers.measured_stage_times`, S's slowness included):

- **nothing**: the current split at the measured times;
- **rebalance**: the split re-made for the measured times (`stragglers.rebalanced`): the nodes
  stay, S's pipeline gets fewer microbatches;
- **spare**: a ready hot spare takes S's stage (`spares.substitute`) at the planner's split, as a
  drain with a spare does; the spare is estimated as fast as S's peers (S's measured time over
  its speed factor). Its one-time cost, the fetch of S's stage's shards, is left out of the step
  estimate;
- **drop**: S is drained and the others re-planned (`templates.replanning.replan`, as for a
  drain), at the planner's split; each node is estimated at its measured seconds a layer and
  microbatch times its new stage's layers (the embedding and head are not told apart).

`choose` takes the cheapest option if it beats doing nothing by `gain`; on a tie the one that
changes least (rebalance, then spare, then drop). Pure: the leader reads etcd, this decides.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from elastic.planning.spares import substitute
from elastic.planning.stragglers import planner_split, rebalanced
from templates.cost import pipeline_time
from templates.plan import Plan
from templates.replanning import replan
from templates.template_set import PlanningError, TemplateSet

Kind = Literal["rebalance", "spare", "drop"]
_ORDER: dict[str, int] = {"rebalance": 0, "spare": 1, "drop": 2}


@dataclass(frozen=True, kw_only=True)
class Option:
    """One thing the leader can do about straggler `node`, and its estimated step time."""

    kind: Kind
    node: int
    plan: Plan
    step_s: float
    spare: int | None = None
    """The spare that takes the node's stage (kind spare)."""


@dataclass(frozen=True, kw_only=True)
class Options:
    """Every option for one straggler, beside doing nothing."""

    node: int
    unchanged_s: float
    options: tuple[Option, ...]

    def summary(self) -> str:
        """`nothing 0.120 s, rebalance 0.090 s, spare 0.061 s` (estimated step times)."""
        parts = [f"nothing {self.unchanged_s:.3f} s", *(f"{o.kind} {o.step_s:.3f} s" for o in self.options)]
        return ", ".join(parts)


def step_time(plan: Plan, stage_times: Mapping[int, float]) -> float:
    """The slowest pipeline's 1F1B time of `plan` at `stage_times` (node -> seconds a microbatch)."""
    return max(pipeline_time([stage_times[s.node] for s in pipe.stages], pipe.microbatches, pipe.virtual_stages)
               for pipe in plan.pipelines)


def straggler_options(tset: TemplateSet, plan: Plan, stage_times: Mapping[int, float], *, node: int,
                      factor: float, spare: int | None) -> Options:
    """The options for straggler `node` of `plan` (module doc); `stage_times` must cover every node
    of the plan, `factor` is the node's speed factor, `spare` a ready spare or None."""
    missing = sorted(set(plan.nodes) - set(stage_times))
    if missing or node not in stage_times:
        raise ValueError(f"no measured stage time for nodes {missing or [node]} of the plan")
    balance = rebalanced(plan, stage_times)
    out = [Option(kind="rebalance", node=node, plan=balance.plan, step_s=balance.step_s)]
    if spare is not None:
        swapped = substitute(planner_split(tset, plan), {node: spare})
        times = {spare if n == node else n: t for n, t in stage_times.items()}
        times[spare] = stage_times[node] / max(factor, 1.0)
        out.append(Option(kind="spare", node=node, plan=swapped, step_s=step_time(swapped, times), spare=spare))
    dropped = _drop(tset, plan, stage_times, node)
    if dropped is not None:
        out.append(dropped)
    return Options(node=node, unchanged_s=balance.unchanged_s, options=tuple(out))


def _drop(tset: TemplateSet, plan: Plan, stage_times: Mapping[int, float], node: int) -> Option | None:
    """The plan without `node` and its estimate, or None when the others cannot form the plan's
    f+1 pipelines."""
    others = sorted(n for n in plan.nodes if n != node)
    if not others:
        return None
    try:
        new = replan(tset, plan, others, global_microbatches=plan.global_microbatches,
                     fault_tolerance=plan.fault_tolerance).plan
    except PlanningError:
        return None
    per_layer = {s.node: stage_times[s.node] / max(len(s.held), 1)
                 for pipe in plan.pipelines for s in pipe.stages if s.node != node}
    times = {s.node: per_layer[s.node] * max(len(s.held), 1) for pipe in new.pipelines for s in pipe.stages}
    return Option(kind="drop", node=node, plan=new, step_s=step_time(new, times))


def choose(options: Options, *, gain: float) -> Option | None:
    """The cheapest option if its estimate is at most (1 - gain) of doing nothing's, else None."""
    if not options.options:
        return None
    best = min(options.options, key=lambda o: (o.step_s, _ORDER[o.kind]))
    return best if best.step_s <= (1.0 - gain) * options.unchanged_s else None
