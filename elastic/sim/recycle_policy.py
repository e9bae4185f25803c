"""The ReCycle-like policy (Gandhi et al., SOSP 2024): a failed stage's microbatches rerouted
to the same stage of the other pipelines, with no re-plan and no state transfer."""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.planning.stragglers import template_stage_times
from elastic.sim.config import RecoveryCosts
from elastic.sim.pace import Stretch
from elastic.sim.planbook import PlanBook
from elastic.sim.reroute import Rerouting
from elastic.sim.result import PolicyResult, Segment, add_segment
from elastic.sim.slowness import note_speed
from elastic.sim.trace import MEMBERSHIP, Trace, TraceEvent
from templates.plan import Plan


class RecyclePolicy:
    """Keep the data-parallel pipelines; peers of a failed node's stage take its microbatches.

    Assumptions (also printed with the results):
    - Plans are homogeneous, as for checkpoint-restart: D identical pipelines of the best
      template depth d (real template search, f = 0) over the initial nodes; leftover nodes
      idle. The plan never changes: no re-plan, no state transfer on a failure (the peers of a
      stage already hold its layers).
    - Step time (elastic/sim/reroute.py): a failed node's microbatches of its stage are spread
      over the surviving nodes of that stage; each pipeline takes its 1F1B fill and drain plus
      its most loaded stage's remaining work, and the step the slowest pipeline's time. A share
      `recycle_hidden` of the extra work goes into the receiving stage's pipeline bubbles (never
      more than its idle time in the failure-free step). ReCycle reports 1.46x Oobleck's
      throughput under failures; this model takes none of its numbers.
    - Failure of a used node: detection (`RecoveryCosts.detection_s`) + group rebuild
      (`rebuild_s`), the in-flight step lost; a failure during a recovery starts it again.
    - A stage that lost every node needs a checkpoint restart: not modelled, the run stalls.
    - A join waits for the step boundary; the node takes the place of a failed one (the stage
      with the most failed nodes, then the lowest pipeline), fetching that stage's weights + AdamW
      state from a peer at the shard transfer rate, then a group rebuild; no work is lost. With
      no failed place left it idles. Idle nodes never replace failed ones.
    - Slow nodes: nothing is done about them: a slow node's stage takes factor x its time.
    """

    name = "recycle"

    def __init__(self, book: PlanBook, costs: RecoveryCosts) -> None:
        self.book = book
        self.costs = costs

    def assumptions(self) -> list[str]:
        c, cl = self.costs, self.book.cluster
        return [
            "homogeneous plans: D identical pipelines of the best depth (as checkpoint-restart), leftover nodes "
            "idle; never re-planned",
            "failure: a failed node's microbatches of its stage run on the same stage of the surviving pipelines "
            "(no re-plan, no transfer); step = the slowest pipeline's 1F1B fill + drain + its most loaded stage's "
            f"work, {c.recycle_hidden:g} of the rerouted work hidden in that stage's bubbles (at most its idle time)",
            f"failure: detection {c.detect_s:g} s (a lost host) or {c.detect_process_s * 1e3:g} ms (lost processes) "
            f"+ rebuild {c.rebuild_s:g} s (the same measured figures as elastic); the in-flight step is lost",
            f"join: at a step boundary the node takes a failed node's place, fetching its stage at {c.transfer_text(cl)} "
            "+ rebuild; no work lost; with no place free it idles",
            "a stage with no node left: checkpoint restart not modelled, the run stalls; slow nodes: nothing is done",
        ]

    def run(self, trace: Trace, horizon_s: float) -> PolicyResult:
        res = PolicyResult(policy=self.name, assumptions=self.assumptions())
        plan = self.book.shape_plan("flat", list(range(trace.initial_nodes)))
        if plan is None:
            res.infeasible = "no homogeneous plan fits the initial cluster"
            res.recovery_s = horizon_s
            return res
        state = _State(plan=plan, base=_slot_times(self.book, plan),
                       stretch=Stretch(start_s=0.0, iteration_s=plan.iteration_time))
        add_segment(res, state.segment(0.0, trace.initial_nodes, plan.iteration_time))
        live = trace.initial_nodes
        for ev in trace.until(horizon_s).events:
            if ev.event in MEMBERSHIP:
                live += 1 if ev.event == "join" else -1
                self._membership(state, res, ev, live, horizon_s)
            elif state.running:
                self._speed(state, res, ev, live)
            else:
                note_speed(state.factors, ev.node, ev.factor)
        if state.running:
            state.stretch.finish(res, horizon_s)
        res.samples = res.steps * self.book.cluster.global_batch
        res.recovery_s = horizon_s - res.training_s - res.checkpoint_s
        return res

    def _membership(self, state: _State, res: PolicyResult, ev: TraceEvent, live: int, horizon_s: float) -> None:
        if ev.event == "fail":
            res.failures += 1
            state.factors.pop(ev.node, None)
            place = state.place_of.pop(ev.node, None)
            if place is None or not state.running:
                return  # an idle node, or nothing runs
            state.stretch.interrupt(res, ev.time_s)
            state.holes.add(place)
            resume = ev.time_s + self.costs.detection_s(ev.cause) + self.costs.rebuild_s
        else:
            res.joins += 1
            if not state.holes or not state.running:
                return  # it idles
            t = ev.time_s
            if t > state.stretch.start_s:
                t = min(horizon_s, state.stretch.boundary(t))
            state.stretch.interrupt(res, t)  # at a boundary (or during a recovery): nothing lost
            place = state.fill(ev.node)
            fetch = _stage_bytes(self.book, state.plan, place[1])
            resume = t + fetch / self.costs.transfer_bytes_per_s(self.book.cluster) + self.costs.rebuild_s
        res.reconfigurations += 1
        step = state.step_s(self.costs.recycle_hidden)
        if step is None:
            res.stalled_at = ev.time_s
            state.running = False
            return
        state.stretch = Stretch(start_s=resume, iteration_s=step)
        add_segment(res, state.segment(resume, live, step))

    def _speed(self, state: _State, res: PolicyResult, ev: TraceEvent, live: int) -> None:
        """A node slows down or recovers: the pace changes, nothing else."""
        note_speed(state.factors, ev.node, ev.factor)
        if ev.node not in state.place_of:
            return
        step = state.step_s(self.costs.recycle_hidden)
        assert step is not None  # no new hole
        state.stretch = state.stretch.repace(res, ev.time_s, step)
        add_segment(res, state.segment(state.stretch.start_s, live, step))


@dataclass
class _State:
    """The ReCycle policy's fixed plan, its failed places and its pace."""

    plan: Plan
    base: list[list[float]]
    """Template stage time of each place (pipeline, stage)."""
    stretch: Stretch
    holes: set[tuple[int, int]] = field(default_factory=set)
    """Places whose node failed."""
    place_of: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Node -> the place it runs (idle nodes have none)."""
    rerouting: Rerouting = field(init=False)
    """The plan's step as holes and slow nodes change it."""
    factors: dict[int, float] = field(default_factory=dict)
    """Slow nodes -> factor."""
    running: bool = True
    """False once stalled."""

    def __post_init__(self) -> None:
        self.place_of = {st.node: (p, s) for p, pipe in enumerate(self.plan.pipelines)
                         for s, st in enumerate(pipe.stages)}
        self.rerouting = Rerouting(self.base, [pipe.microbatches for pipe in self.plan.pipelines])

    def fill(self, node: int) -> tuple[int, int]:
        """Put `node` in a failed place: the stage with the most holes, then the lowest pipeline."""
        per_stage: dict[int, int] = {}
        for _, s in self.holes:
            per_stage[s] = per_stage.get(s, 0) + 1
        stage = min(per_stage, key=lambda s: (-per_stage[s], s))
        place = min(h for h in self.holes if h[1] == stage)
        self.holes.remove(place)
        self.place_of[node] = place
        return place

    def step_s(self, hidden: float) -> float | None:
        """`rerouted_step_s` over the holes and the slow nodes' places (the others at their
        template time)."""
        changed: dict[tuple[int, int], float | None] = dict.fromkeys(self.holes)
        for node, factor in self.factors.items():
            place = self.place_of.get(node)  # a running node's, never a hole
            if place is not None:
                changed[place] = self.base[place[0]][place[1]] * factor
        return self.rerouting.step_s(changed, hidden=hidden)

    def segment(self, start_s: float, live: int, step: float) -> Segment:
        return Segment(start_s=start_s, live=live, used=len(self.place_of), pipelines=len(self.plan.pipelines),
                       iteration_s=step)


def _slot_times(book: PlanBook, plan: Plan) -> list[list[float]]:
    times = template_stage_times(book.flat, plan)
    return [[times[st.node] for st in pipe.stages] for pipe in plan.pipelines]


def _stage_bytes(book: PlanBook, plan: Plan, stage: int) -> int:
    """Weights + AdamW state of stage `stage` of `plan`'s (identical) pipelines."""
    return book.stage_bytes(plan.pipelines[0].stages[stage])
