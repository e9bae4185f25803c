"""The redundant-computation policy (Bamboo-like): each stage also runs its successor's layers."""

from __future__ import annotations

from elastic.sim.config import RecoveryCosts
from elastic.sim.planbook import PlanBook
from elastic.sim.result import PolicyResult, segment_of, train_interrupted, whole_steps
from elastic.sim.trace import Trace
from templates.plan import Plan


class RedundantPolicy:
    """Failures are absorbed by the predecessor, which already holds the lost stage's layers.

    Assumptions (also printed with the results):
    - Every stage holds a copy of its successor's layers (weights, gradients and AdamW state:
      the layer's static memory doubles, so a pipeline may need more nodes) and runs their
      forward pass eagerly: a layer's forward time grows by `redundant_forward` x itself. With
      backward = 2 x forward FLOPs that is up to 1/3 more compute per step (1.33x); the Bamboo
      paper places this work in pipeline bubbles, which `redundant_forward` < 1 models. This
      1.33x upper bound is our own arithmetic from the FLOP counts, not a number from the paper.
    - Plans are homogeneous (Bamboo runs D identical pipelines): the best depth from the real
      template search on that redundant profile, f = 0; leftover nodes are spares.
    - Failure of a used node: detection (lease TTL), the in-flight step is lost, the planner's
      wall time, re-protection = one node fetches 2 x the failed stage's weights + AdamW state
      over its NIC, and a rebuild; then the best homogeneous plan over the survivors (optimistic:
      Bamboo's own re-shaping is more constrained).
    - Two failures of adjacent stages of one pipeline before re-protection finishes lose a
      layer's every copy: Bamboo would restart from a checkpoint; not modelled: the run stalls.
    - Spare failures cost nothing; a join re-plans (as a failure, without detection) only if it
      allows a faster plan.
    """

    name = "redundant"

    def __init__(self, book: PlanBook, costs: RecoveryCosts) -> None:
        self.book = book
        self.costs = costs

    def assumptions(self) -> list[str]:
        c, cl = self.costs, self.book.cluster
        return [
            f"each stage holds its successor's layers (static memory x2) and runs their forward "
            f"(forward x{1 + c.redundant_forward:g}: {c.redundant_forward:g} of it not hidden in bubbles)",
            "homogeneous plans (Bamboo): D identical pipelines of the best depth on the redundant profile, spares idle",
            f"failure: detection {c.detect_s:g} s + planner wall time"
            + ("" if c.replan_s is None else f" fixed at {c.replan_s:g} s")
            + f" + fetch 2x the lost stage's state at {cl.network_gbps:g} Gbit/s + rebuild {c.rebuild_s:g} s; "
            "the in-flight step is lost",
            "adjacent stages lost before re-protection: checkpoint restart not modelled, the run stalls",
        ]

    def run(self, trace: Trace, horizon_s: float) -> PolicyResult:
        book, costs = self.book, self.costs
        res = PolicyResult(policy=self.name, assumptions=self.assumptions())
        live = set(range(trace.initial_nodes))
        if book.redundant is None:
            res.infeasible = f"the redundant copy does not fit: {book.redundant_error}"
            res.recovery_s = horizon_s
            return res
        plan = book.shape_plan("redundant", sorted(live))
        if plan is None:
            res.infeasible = "no homogeneous redundant plan fits the initial cluster"
            res.recovery_s = horizon_s
            return res
        protected = plan  # the plan whose redundancy is complete
        lost_in_window: set[int] = set()
        resume = 0.0
        current: Plan | None = plan
        res.segments.append(segment_of(0.0, len(live), plan))
        for ev in trace.until(horizon_s).events:
            t = ev.time_s
            if ev.event == "fail":
                res.failures += 1
                live.discard(ev.node)
                if current is None or ev.node not in current.nodes:
                    continue
                if t > resume:
                    train_interrupted(res, t - resume, current.iteration_time)
                    protected, lost_in_window = current, set()
                if lost_in_window & _neighbours(protected, ev.node):
                    res.stalled_at = t
                    current = None
                    continue
                lost_in_window.add(ev.node)
                fetch = 2 * _stage_bytes(book, protected, ev.node)
                cost = costs.detect_s
            else:
                res.joins += 1
                live.add(ev.node)
                if current is None:
                    continue
                better = book.shape("redundant", len(live))
                if better is None or better.iteration_time >= current.iteration_time:
                    continue
                if t > resume:
                    train_interrupted(res, t - resume, current.iteration_time)
                    protected, lost_in_window = current, set()
                cost = 0.0
                fetch = -1  # set below from the new plan
            new = book.shape_plan("redundant", sorted(live))
            if new is None:
                res.stalled_at = t
                current = None
                continue
            shape = book.shape("redundant", len(live))
            assert shape is not None
            if fetch < 0:
                fetch = 2 * _stage_bytes(book, new, ev.node) if ev.node in new.nodes else 0
            planning = shape.planning_s if costs.replan_s is None else costs.replan_s
            resume = t + cost + planning + fetch / book.cluster.network_bytes_per_s + costs.rebuild_s
            current = new
            res.reconfigurations += 1
            res.segments.append(segment_of(resume, len(live), new))
        if current is not None and horizon_s > resume:
            ran = horizon_s - resume
            res.steps += whole_steps(ran, current.iteration_time)
            res.training_s += ran
        res.samples = res.steps * book.cluster.global_batch
        res.recovery_s = horizon_s - res.training_s - res.checkpoint_s
        return res


def _neighbours(plan: Plan, node: int) -> set[int]:
    """The nodes running the stages just before and after `node`'s in its pipeline."""
    for pipe in plan.pipelines:
        nodes = list(pipe.nodes)
        if node in nodes:
            i = nodes.index(node)
            return set(nodes[max(0, i - 1) : i]) | set(nodes[i + 1 : i + 2])
    return set()


def _stage_bytes(book: PlanBook, plan: Plan, node: int) -> int:
    """Weights + AdamW state (base profile) of the stage `node` runs in `plan` (0 for a spare)."""
    for pipe in plan.pipelines:
        for st in pipe.stages:
            if st.node == node:
                return sum(book.profile.layer_bytes(i) for i in range(st.first, st.last))
    return 0
