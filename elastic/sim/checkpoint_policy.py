"""The checkpoint-restart policy (Varuna-like): every loss of a used node restarts the job."""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastic.sim.config import RecoveryCosts
from elastic.sim.planbook import PlanBook
from elastic.sim.result import PolicyResult, segment_of, whole_steps
from elastic.sim.trace import Trace
from templates.plan import Plan


def young_interval(write_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval sqrt(2 x write time x mean time between failures)."""
    return math.sqrt(2.0 * write_s * mtbf_s)


@dataclass(frozen=True, kw_only=True)
class Progress:
    """Where a run stands `elapsed` seconds after it (re)started, under periodic checkpoints.

    The run alternates K steps of training and one blocking checkpoint write of `write_s`.
    """

    steps_run: int
    """Steps completed."""
    steps_saved: int
    """Steps covered by the last completed checkpoint."""
    training_s: float
    """Seconds spent computing."""
    writing_s: float
    """Seconds spent writing checkpoints (a write cut short included)."""

    @classmethod
    def after(cls, elapsed: float, *, iteration_s: float, every_steps: int, write_s: float) -> Progress:
        train_block = every_steps * iteration_s
        cycle = train_block + write_s
        full = int(math.floor(elapsed / cycle + 1e-12)) if elapsed > 0 else 0
        rem = max(0.0, elapsed - full * cycle)
        running = min(rem, train_block)
        return cls(
            steps_run=full * every_steps + min(every_steps, whole_steps(running, iteration_s)),
            steps_saved=full * every_steps,
            training_s=full * train_block + running,
            writing_s=full * write_s + max(0.0, rem - train_block),
        )


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
        how = "given" if c.checkpoint_interval_s is not None else "Young's optimum for the trace"
        return [
            "homogeneous plans (Varuna): D identical pipelines of the best depth, spares idle",
            f"checkpoint of {self.book.model_bytes / 1e9:.2f} GB every {interval:.0f} s of training ({how}), "
            f"blocking for {self.write_s:.1f} s at {c.storage_gbps:g} Gbit/s",
            f"restart: process start {c.process_start_s:g} s + load {self.write_s:.1f} s + planner wall time"
            + ("" if c.replan_s is None else f" fixed at {c.replan_s:g} s")
            + "; work since the last completed checkpoint is lost",
            "spare failures cost nothing; a join restarts (after a checkpoint) only if it allows a faster plan",
        ]

    def run(self, trace: Trace, horizon_s: float) -> PolicyResult:
        book = self.book
        res = PolicyResult(policy=self.name, assumptions=self.assumptions(trace, horizon_s))
        interval = self.interval_s(trace, horizon_s)
        live = set(range(trace.initial_nodes))
        plan = book.shape_plan("flat", sorted(live))
        if plan is None:
            res.infeasible = "no homogeneous plan fits the initial cluster"
            res.recovery_s = horizon_s
            return res
        resume = 0.0
        res.segments.append(segment_of(0.0, len(live), plan))

        def progress(until: float, current: Plan) -> Progress:
            it = current.iteration_time
            every = max(1, round(interval / it)) if math.isfinite(interval) else whole_steps(horizon_s, it) + 1
            return Progress.after(until - resume, iteration_s=it, every_steps=every, write_s=self.write_s)

        for ev in trace.until(horizon_s).events:
            t = ev.time_s
            if ev.event == "fail":
                res.failures += 1
                live.discard(ev.node)
                if plan is None or ev.node not in plan.nodes:
                    continue  # stalled, or a spare
                if t > resume:
                    p = progress(t, plan)
                    res.steps += p.steps_saved
                    res.training_s += p.training_s
                    res.checkpoint_s += p.writing_s
                    res.lost_s += p.training_s - p.steps_saved * plan.iteration_time
            else:
                res.joins += 1
                live.add(ev.node)
                if plan is None:
                    continue
                faster = book.shape("flat", len(live))
                if faster is None or faster.iteration_time >= plan.iteration_time:
                    continue  # a spare
                if t > resume:
                    p = progress(t, plan)
                    res.steps += p.steps_run
                    res.training_s += p.training_s
                    write = min(self.write_s, horizon_s - t)  # the checkpoint taken for the restart
                    res.checkpoint_s += p.writing_s + write
                    res.lost_s += p.training_s - p.steps_run * plan.iteration_time
                    t += write
            plan = book.shape_plan("flat", sorted(live))
            if plan is None:
                res.stalled_at = t
                continue
            resume = t + self.restart_s(len(live))
            res.restarts += 1
            res.segments.append(segment_of(resume, len(live), plan))
        if plan is not None and horizon_s > resume:
            p = progress(horizon_s, plan)
            res.steps += p.steps_run
            res.training_s += p.training_s
            res.checkpoint_s += p.writing_s
        res.samples = res.steps * book.cluster.global_batch
        res.recovery_s = horizon_s - res.training_s - res.checkpoint_s
        return res
