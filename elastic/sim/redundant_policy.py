"""The redundant-computation policy (Bamboo-like): each stage also runs its successor's layers."""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.sim.config import RecoveryCosts
from elastic.sim.pace import Stretch
from elastic.sim.planbook import PlanBook
from elastic.sim.result import PolicyResult, add_segment, segment_of
from elastic.sim.slowness import note_speed, slow_step_s
from elastic.sim.trace import MEMBERSHIP, Trace, TraceEvent
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
    - Failure of a used node: detection (`RecoveryCosts.detection_s`: lease TTL, or the node
      monitor when only processes die), the in-flight step is lost, the planner's wall time,
      re-protection = one node fetches 2 x the failed stage's weights + AdamW state at the
      shard transfer rate (`RecoveryCosts.transfer_bytes_per_s`), and a rebuild; then the best
      homogeneous plan over the survivors (optimistic:
      Bamboo's own re-shaping is more constrained).
    - Two failures of adjacent stages of one pipeline before re-protection finishes lose a
      layer's every copy: Bamboo would restart from a checkpoint; not modelled: the run stalls.
    - Spare failures cost nothing; a join re-plans (as a failure, without detection) only if it
      allows a faster plan.
    - Slow nodes: nothing is done about them (Bamboo has no straggler policy): a slow node's
      stage takes factor x its cost-model time on the redundant profile, and every step waits for
      the slowest pipeline (elastic/sim/slowness.py); plans are chosen as if every node were at
      full speed. A failing node loses its slowness.
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
            f"failure: detection {c.detect_s:g} s (a lost host) or {c.detect_process_s * 1e3:g} ms (lost processes) "
            "+ planner wall time"
            + ("" if c.replan_s is None else f" fixed at {c.replan_s:g} s")
            + f" + fetch 2x the lost stage's state at {c.transfer_text(cl)} + rebuild {c.rebuild_s:g} s; "
            "the in-flight step is lost (detection, transfer and rebuild as for elastic, the same measured figures)",
            "adjacent stages lost before re-protection: checkpoint restart not modelled, the run stalls",
        ]

    def straggler_assumptions(self) -> list[str]:
        return ["slow nodes: nothing is done about them; a slow stage takes factor x its cost-model time and every "
                "step waits for the slowest pipeline; plans are chosen as if every node were at full speed"]

    def run(self, trace: Trace, horizon_s: float) -> PolicyResult:
        book = self.book
        slow = trace.until(horizon_s).slowdowns > 0
        res = PolicyResult(policy=self.name,
                           assumptions=self.assumptions() + (self.straggler_assumptions() if slow else []))
        if book.redundant is None:
            res.infeasible = f"the redundant copy does not fit: {book.redundant_error}"
            res.recovery_s = horizon_s
            return res
        plan = book.shape_plan("redundant", list(range(trace.initial_nodes)))
        if plan is None:
            res.infeasible = "no homogeneous redundant plan fits the initial cluster"
            res.recovery_s = horizon_s
            return res
        state = _State(res=res, live=set(range(trace.initial_nodes)), current=plan, protected=plan,
                       stretch=Stretch(start_s=0.0, iteration_s=plan.iteration_time))
        res.segments.append(segment_of(0.0, len(state.live), plan))
        for ev in trace.until(horizon_s).events:
            if ev.event in MEMBERSHIP:
                self._membership(state, ev)
            else:
                self._speed(state, ev)
        if state.current is not None:
            state.stretch.finish(res, horizon_s)
        res.samples = res.steps * book.cluster.global_batch
        res.recovery_s = horizon_s - res.training_s - res.checkpoint_s
        return res

    def _speed(self, state: _State, ev: TraceEvent) -> None:
        """A node slows down or recovers: the pace changes, nothing else."""
        note_speed(state.factors, ev.node, ev.factor)
        if state.current is None or ev.node not in state.current.nodes:
            return
        assert self.book.redundant is not None
        step = slow_step_s(self.book.redundant, state.current, state.factors)
        state.stretch = state.stretch.repace(state.res, ev.time_s, step)
        add_segment(state.res, segment_of(state.stretch.start_s, len(state.live), state.current, step))

    def _membership(self, state: _State, ev: TraceEvent) -> None:
        book, costs, res, t = self.book, self.costs, state.res, ev.time_s
        if ev.event == "fail":
            res.failures += 1
            state.live.discard(ev.node)
            state.factors.pop(ev.node, None)
            if state.current is None or ev.node not in state.current.nodes:
                return
            self._interrupt(state, t)
            if state.lost_in_window & _neighbours(state.protected, ev.node):
                res.stalled_at = t
                state.current = None
                return
            state.lost_in_window.add(ev.node)
            fetch = 2 * _stage_bytes(book, state.protected, ev.node)
            cost = costs.detection_s(ev.cause)
        else:
            res.joins += 1
            state.live.add(ev.node)
            if state.current is None:
                return
            better = book.shape("redundant", len(state.live))
            if better is None or better.iteration_time >= state.current.iteration_time:
                return
            self._interrupt(state, t)
            cost = 0.0
            fetch = -1  # set below from the new plan
        self._replan(state, ev, t, cost=cost, fetch=fetch)

    def _interrupt(self, state: _State, t: float) -> None:
        if t > state.stretch.start_s:
            state.stretch.interrupt(state.res, t)
            state.protected, state.lost_in_window = state.current or state.protected, set()

    def _replan(self, state: _State, ev: TraceEvent, t: float, *, cost: float, fetch: int) -> None:
        book, costs, res = self.book, self.costs, state.res
        new = book.shape_plan("redundant", sorted(state.live))
        if new is None:
            res.stalled_at = t
            state.current = None
            return
        shape = book.shape("redundant", len(state.live))
        assert shape is not None and book.redundant is not None
        if fetch < 0:
            fetch = 2 * _stage_bytes(book, new, ev.node) if ev.node in new.nodes else 0
        planning = shape.planning_s if costs.replan_s is None else costs.replan_s
        resume = t + cost + planning + fetch / costs.transfer_bytes_per_s(book.cluster) + costs.rebuild_s
        state.current = new
        step = slow_step_s(book.redundant, new, state.factors)
        state.stretch = Stretch(start_s=resume, iteration_s=step)
        res.reconfigurations += 1
        res.segments.append(segment_of(resume, len(state.live), new, step))


@dataclass
class _State:
    """The redundant policy's run between events."""

    res: PolicyResult
    live: set[int]
    current: Plan | None
    """The plan that runs; None once stalled."""
    protected: Plan
    """The plan whose redundancy is complete."""
    stretch: Stretch
    lost_in_window: set[int] = field(default_factory=set)
    """Nodes lost since `protected` was complete."""
    factors: dict[int, float] = field(default_factory=dict)
    """Slow nodes -> factor."""


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
                return book.stage_bytes(st)
    return 0
