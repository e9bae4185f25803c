"""The checkpoint-restart policy (Varuna-like): every loss of a used node restarts the job."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from elastic.sim.checkpoint_clock import CheckpointClock, Progress
from elastic.sim.config import RecoveryCosts
from elastic.sim.planbook import PlanBook
from elastic.sim.result import PolicyResult, add_segment, segment_of, whole_steps
from elastic.sim.slowness import note_speed, slow_step_s
from elastic.sim.trace import MEMBERSHIP, Trace, TraceEvent
from templates.plan import Plan

__all__ = ["CheckpointRestartPolicy", "Progress", "young_interval"]


def young_interval(write_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval sqrt(2 x write time x mean time between failures)."""
    return math.sqrt(2.0 * write_s * mtbf_s)


class CheckpointRestartPolicy:
    """Stop-the-world recovery: restart every process and restore the last checkpoint.

    Assumptions (also printed with the results):
    - Plans are homogeneous, as Varuna's: D identical pipelines of the best template depth d
      (real template search, f = 0), D = n // d; leftover nodes are spares.
    - A checkpoint (one replica's weights + AdamW state, the profile's bytes) is written every K
      steps, blocking training for bytes / storage bandwidth; K = the interval (given, or Young's
      sqrt(2 x write time x trace MTBF), MTBF = horizon / failures) / iteration time, >= 1.
    - Failure of a node the plan uses: everything since the last completed checkpoint is lost
      (a write cut short does not count); restart = process start + checkpoint load at the
      storage bandwidth + planner wall time for the new node count (measured once per count);
      then the best homogeneous plan over the survivors. A failure during a restart restarts it.
    - Failure of a spare: no effect.
    - Join: if the new node count allows a faster plan, checkpoint at once (the partial step is
      lost), then restart as above; otherwise the node is a spare.
    - The work done when the horizon ends counts (as if a final checkpoint were written).
    - Slow nodes: nothing is done about them (Varuna restarts only on a failure): a slow node's
      stage takes factor x its cost-model time, every step waits for the slowest pipeline
      (elastic/sim/slowness.py), K stays as set at the restart, and plans are chosen as if every
      node were at full speed (elastic/sim/checkpoint_clock.py).
    """

    name = "checkpoint-restart"

    def __init__(self, book: PlanBook, costs: RecoveryCosts) -> None:
        self.book = book
        self.costs = costs
        self.write_s = book.model_bytes / costs.storage_bytes_per_s

    def interval_s(self, trace: Trace, horizon_s: float) -> float:
        """Seconds of training between checkpoints for this trace."""
        if self.costs.checkpoint_interval_s is not None:
            return self.costs.checkpoint_interval_s
        failures = trace.until(horizon_s).failures
        return math.inf if failures == 0 else young_interval(self.write_s, horizon_s / failures)

    def restart_s(self, n: int) -> float:
        shape = self.book.shape("flat", n)
        planning = 0.0 if shape is None else shape.planning_s
        if self.costs.replan_s is not None:
            planning = self.costs.replan_s
        return self.costs.process_start_s + self.write_s + planning

    def assumptions(self, trace: Trace, horizon_s: float) -> list[str]:
        c = self.costs
        interval = self.interval_s(trace, horizon_s)
        failures = trace.until(horizon_s).failures
        how = "given" if c.checkpoint_interval_s is not None else (
            f"Young's optimum for the trace's MTBF, {horizon_s / failures / 3600:.3g} h" if failures
            else "no failure in the trace: never")
        llama3 = ["the Llama 3 paper states no checkpoint interval, so none is attributed to it: the interval above "
                  "is Young's optimum for this trace (or --checkpoint-interval)"] if trace.causes() else []
        return [
            "homogeneous plans (Varuna): D identical pipelines of the best depth, spares idle",
            f"checkpoint of {self.book.model_bytes / 1e9:.2f} GB every {interval:.0f} s of training ({how}), "
            f"blocking for {self.write_s:.1f} s at {c.storage_gbps:g} Gbit/s",
            f"restart: process start {c.process_start_s:g} s + load {self.write_s:.1f} s + planner wall time"
            + ("" if c.replan_s is None else f" fixed at {c.replan_s:g} s")
            + "; work since the last completed checkpoint is lost",
            "spare failures cost nothing; a join restarts (after a checkpoint) only if it allows a faster plan",
            *llama3,
        ]

    def straggler_assumptions(self) -> list[str]:
        return ["slow nodes: nothing is done about them; a slow stage takes factor x its cost-model time, every "
                "step waits for the slowest pipeline, checkpoints stay every K steps; plans are chosen as if every "
                "node were at full speed"]

    def every_steps(self, interval: float, plan: Plan, horizon_s: float) -> int:
        """K: steps between checkpoints for `plan` (its full-speed iteration time)."""
        it = plan.iteration_time
        return max(1, round(interval / it)) if math.isfinite(interval) else whole_steps(horizon_s, it) + 1

    def run(self, trace: Trace, horizon_s: float) -> PolicyResult:
        slow = trace.until(horizon_s).slowdowns > 0
        res = PolicyResult(policy=self.name, assumptions=self.assumptions(trace, horizon_s)
                           + (self.straggler_assumptions() if slow else []))
        interval = self.interval_s(trace, horizon_s)
        live = set(range(trace.initial_nodes))
        plan = self.book.shape_plan("flat", sorted(live))
        if plan is None:
            res.infeasible = "no homogeneous plan fits the initial cluster"
            res.recovery_s = horizon_s
            return res
        state = _State(res=res, live=live, plan=plan, interval=interval, horizon_s=horizon_s, resume=0.0,
                       clock=self._clock(0.0, plan, {}, interval, horizon_s))
        res.segments.append(segment_of(0.0, len(live), plan))
        for ev in trace.until(horizon_s).events:
            if ev.event in MEMBERSHIP:
                self._membership(state, ev)
            else:
                self._speed(state, ev)
        if state.plan is not None and horizon_s > state.resume:
            tally = state.clock.tally(horizon_s)
            res.steps += tally.steps_run
            res.training_s += tally.training_s
            res.checkpoint_s += tally.writing_s
        res.samples = res.steps * self.book.cluster.global_batch
        res.recovery_s = horizon_s - res.training_s - res.checkpoint_s
        return res

    def _clock(self, resume: float, plan: Plan, factors: dict[int, float], interval: float,
               horizon_s: float) -> CheckpointClock:
        return CheckpointClock(start_s=resume, iteration_s=slow_step_s(self.book.flat, plan, factors),
                               every_steps=self.every_steps(interval, plan, horizon_s), write_s=self.write_s)

    def _speed(self, state: _State, ev: TraceEvent) -> None:
        """A node slows down or recovers: the pace changes, nothing else."""
        note_speed(state.factors, ev.node, ev.factor)
        if state.plan is None or ev.node not in state.plan.nodes:
            return
        step = slow_step_s(self.book.flat, state.plan, state.factors)
        state.clock, tally = state.clock.repace(ev.time_s, step)
        state.res.training_s += tally.training_s
        state.res.checkpoint_s += tally.writing_s
        add_segment(state.res, segment_of(state.clock.start_s, len(state.live), state.plan, step))

    def _membership(self, state: _State, ev: TraceEvent) -> None:
        book, res, t, plan = self.book, state.res, ev.time_s, state.plan
        if ev.event == "fail":
            res.failures += 1
            state.live.discard(ev.node)
            state.factors.pop(ev.node, None)
            if plan is None or ev.node not in plan.nodes:
                return  # stalled, or a spare
            if t > state.resume:
                tally = state.clock.tally(t)
                res.steps += tally.steps_saved
                res.training_s += tally.training_s
                res.checkpoint_s += tally.writing_s
                res.lost_s += tally.unsaved_s
        else:
            res.joins += 1
            state.live.add(ev.node)
            if plan is None:
                return
            faster = book.shape("flat", len(state.live))
            if faster is None or faster.iteration_time >= plan.iteration_time:
                return  # a spare
            if t > state.resume:
                tally = state.clock.tally(t)
                res.steps += tally.steps_run
                res.training_s += tally.training_s
                write = min(self.write_s, state.horizon_s - t)  # the checkpoint taken for the restart
                res.checkpoint_s += tally.writing_s + write
                res.lost_s += tally.partial_s
                t += write
        self._restart(state, t)

    def _restart(self, state: _State, t: float) -> None:
        state.plan = self.book.shape_plan("flat", sorted(state.live))
        if state.plan is None:
            state.res.stalled_at = t
            return
        state.resume = t + self.restart_s(len(state.live))
        state.clock = self._clock(state.resume, state.plan, state.factors, state.interval, state.horizon_s)
        state.res.restarts += 1
        state.res.segments.append(segment_of(state.resume, len(state.live), state.plan, state.clock.iteration_s))


@dataclass
class _State:
    """The checkpoint-restart policy's run between events."""

    res: PolicyResult
    live: set[int]
    plan: Plan | None
    """The plan that runs; None once stalled."""
    interval: float
    horizon_s: float
    resume: float
    """When training (re)starts after the last restart."""
    clock: CheckpointClock
    factors: dict[int, float] = field(default_factory=dict)
    """Slow nodes -> factor."""
