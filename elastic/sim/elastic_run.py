"""One run of the elastic policy over a trace: the state it carries from event to event.

The policy (`elastic_policy.py`) states the model; this file replays it. Between two events
the run trains at the pace of its plan with the slow nodes' factors (`slowness.py`, `pace.py`);
under straggler policy `rebalance` or `auto` the leader's reactions to slow nodes come due
between events too (`straggler_marks.py`) and are carried out at a step boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elastic.sim.copies import CopyWatch
from elastic.sim.pace import Stretch
from elastic.sim.partial_replay import cut, lost_microbatches, replay_s
from elastic.sim.result import PolicyResult, add_segment, segment_of
from elastic.sim.slowness import resplit, same_split, slow_step_s
from elastic.sim.straggler_marks import Marks
from elastic.sim.trace import MEMBERSHIP, TraceEvent
from templates.plan import Plan

if TYPE_CHECKING:
    from elastic.sim.elastic_policy import ElasticPolicy


@dataclass(frozen=True, kw_only=True)
class Pending:
    """A partial replay's first step: the lost microbatches recomputed on the new plan."""

    microbatches: int
    """Microbatches it recomputes."""
    until: float
    """When it ends (the interrupted step commits), at the pace it started with."""
    lost: float
    """Its seconds, already counted in `lost_s`."""


class ElasticRun:
    """The elastic policy's plan, nodes, spares, slow nodes and results during one run."""

    def __init__(self, policy: ElasticPolicy, *, initial_nodes: int, assumptions: list[str]) -> None:
        self.policy = policy
        self.book = policy.book
        self.costs = policy.costs
        self.res = PolicyResult(policy=policy.name, assumptions=assumptions)
        first = self.book.initial_plan()
        self.base: Plan | None = first
        """The planner's plan (its own split of the microbatches); None once stalled."""
        self.plan: Plan = first
        """What runs: `base`, or `base` re-split for slow nodes."""
        self.live = set(range(initial_nodes))
        """The nodes that train (the spares aside)."""
        self.pool = list(range(initial_nodes, initial_nodes + policy.spares))
        """The spares: up, in no plan (elastic/planning/spares.py); slow ones last."""
        self.factors: dict[int, float] = {}
        """Slow nodes (training or spare) -> how many times as long their compute takes."""
        c = self.costs
        self.marks = Marks(detect_steps=c.straggler_detect_steps, window_steps=c.straggler_window_steps,
                           threshold=c.straggler_threshold)
        self.stretch = Stretch(start_s=0.0, iteration_s=first.iteration_time)
        self.pending: Pending | None = None
        """The replay step of the last partial replay (until it ends, its lost seconds may be undone)."""
        self.res.segments.append(segment_of(0.0, len(self.live), first))
        self.watch = CopyWatch()
        """Each failure's window until the re-plan's copies are in place (issue 55's trade)."""
        self.res.copies = self.watch.counts

    @property
    def reacts(self) -> bool:
        """Whether the leader acts on slow nodes (straggler policy other than off)."""
        return self.policy.stragglers != "off"

    def on_event(self, ev: TraceEvent, horizon_s: float) -> None:
        if ev.event in MEMBERSHIP:
            self._membership(ev, horizon_s)
        else:
            self._speed(ev)

    def finish(self, horizon_s: float) -> PolicyResult:
        res = self.res
        if self.base is not None:
            self.stretch.finish(res, horizon_s)
        res.samples = res.steps * self.book.cluster.global_batch
        res.recovery_s = horizon_s - res.training_s - res.checkpoint_s
        return res

    # ---- membership: as without slow nodes, their slowness carried into the new plan -------

    def _membership(self, ev: TraceEvent, horizon_s: float) -> None:
        res, t = self.res, ev.time_s
        if ev.event == "fail":
            self.factors.pop(ev.node, None)  # a failing node loses its slowness
        if self.policy.spare_event(ev.event, ev.node, self.live, self.pool, res):
            self._sort_pool()
            return  # a spare lost, or a node back as a spare: the plan is untouched
        if ev.event == "join" and self.base is not None and t > self.stretch.start_s:
            t = min(horizon_s, self.stretch.boundary(t))  # the step boundary
        wait_s, replay = self._settle(ev, t) if self.base is not None else (0.0, self.book.mbs)
        swap: dict[int, int] = {}
        if ev.event == "fail":
            if self.base is not None and ev.node in self.base.nodes:
                self.watch.failure(self.base, ev.node, t)
            self.live.discard(ev.node)
            res.failures += 1
            self.marks.drop(ev.node)
            if self.pool and self.base is not None and ev.node in self.base.nodes:  # the re-plan takes a spare in
                swap[ev.node] = self.pool.pop(0)
                self.live.add(swap[ev.node])
                res.spares_taken += 1
        else:
            self.live.add(ev.node)
            res.joins += 1
        if self.base is None:
            return
        new, planning_s = (self.policy.spare_swap(self.base, swap) if swap
                           else self.policy.replan_over(self.base, sorted(self.live)))
        if new is None:
            res.stalled_at = t
            self.base = None
            return
        fetch = max(new.fetch_bytes.values(), default=0)
        resume = t + wait_s + planning_s + fetch / self.costs.transfer_bytes_per_s(self.book.cluster) \
            + self.costs.rebuild_s
        res.reconfigurations += 1
        if ev.event == "fail":
            self.watch.protected(resume)
        self._start(new.plan, new.plan, resume, replanned=True, replay=replay, horizon_s=horizon_s)

    def _settle(self, ev: TraceEvent, t: float) -> tuple[float, int]:
        """Training until the change at `t` (partial_replay.py): (seconds from `t` until the
        leader re-plans, microbatches of the interrupted step the new plan computes first).

        A join comes at a step boundary (or during a recovery, whose pending replay it keeps). A
        failure during a recovery or during a replay step makes the whole step replayed (a
        simplification: the runtime may keep more); else `cut` decides."""
        st, res, mbs = self.stretch, self.res, self.book.mbs
        pending, self.pending = self.pending, None
        live_replay, waiting = False, mbs
        if pending is not None and t < pending.until:  # the replay does not complete
            live_replay = True
            res.lost_s -= pending.lost  # counted when it was planned
            if t <= st.start_s:
                waiting = pending.microbatches  # not started: still to do
        if ev.event == "join":
            st.interrupt(res, t)  # at a boundary, or before training resumed: nothing lost
            return 0.0, waiting
        detect_s = self.costs.detection_s(ev.cause)
        if t <= st.start_s or live_replay:
            st.interrupt(res, t)
            return detect_s, mbs
        c = cut(st.in_flight(t), st.iteration_s, detect_s=detect_s, finish_from=self.costs.finish_from,
                partial=self.costs.partial_replay)
        if not c.finish:
            st.interrupt(res, t)
            return c.wait_s, mbs
        st.commit(res, t)  # the steps before count; the in-flight one waits for its replay
        return c.wait_s, lost_microbatches(self.plan, {ev.node})

    def _start(self, base: Plan, plan: Plan, resume: float, *, replanned: bool, replay: int | None = None,
               horizon_s: float = math.inf) -> None:
        """Train `plan` (a split of `base`) from `resume` on, at its pace with the slow nodes;
        `replay` (< the global microbatches): the interrupted step's microbatches to compute first."""
        self.base, self.plan = base, plan
        tset = self.policy.tset
        step = slow_step_s(tset, plan, self.factors)
        carried = 0.0
        if replay is not None and replay < self.book.mbs:
            r = replay_s(tset, plan, self.factors, replay)
            carried = min(1.0 - r / step, 1.0 - 1e-9)
            lost = min(r, max(0.0, horizon_s - resume))
            self.res.lost_s += lost  # recomputing the lost pipelines' microbatches
            self.pending = Pending(microbatches=replay, until=resume + r, lost=lost)
        self.stretch = Stretch(start_s=resume, iteration_s=step, carried=max(0.0, carried))
        self.res.segments.append(segment_of(resume, len(self.live), plan, step))
        if replanned and self.reacts:
            self.marks.replanned(plan.nodes, self.factors, start_s=resume, step_s=step)

    def _sort_pool(self) -> None:
        self.pool.sort(key=lambda node: (node in self.factors, node))

    # ---- speed: a node slows down or recovers -------------------------------------------------

    def _speed(self, ev: TraceEvent) -> None:
        if ev.event == "slow":
            assert ev.factor is not None
            self.factors[ev.node] = ev.factor
        else:
            self.factors.pop(ev.node, None)
        self._sort_pool()
        if self.base is None or ev.node not in self.plan.nodes:
            return  # a spare's speed, or nothing trains
        step = slow_step_s(self.policy.tset, self.plan, self.factors)
        self.stretch = self.stretch.repace(self.res, ev.time_s, step)
        start = self.stretch.start_s
        add_segment(self.res, segment_of(start, len(self.live), self.plan, step))
        if not self.reacts:
            return
        if ev.factor is not None:
            self.marks.slowed(ev.node, ev.factor, start_s=start, step_s=step)
        else:
            self.marks.recovered(ev.node, start_s=start, step_s=step)

    # ---- the leader's reactions to marked nodes ---------------------------------------------

    def act_until(self, t: float) -> None:
        """Carry out every reaction whose step boundary comes at or before `t`."""
        while self.reacts and self.base is not None:
            due = self.marks.next_due()
            if due is None:
                return
            boundary = self.stretch.boundary(max(due, self.stretch.start_s))
            if boundary > t:
                return
            self.marks.apply(boundary)
            self._react(boundary)

    def _react(self, t: float) -> None:
        """At step boundary `t`: replace marked nodes by spares (auto, if it pays), else re-split
        for the slow nodes while one is marked, else bring the planner's split back."""
        assert self.base is not None
        marked = sorted(n for n in self.marks.marked if n in self.base.nodes)
        if self.policy.stragglers == "auto" and marked:
            swap = self._spares_for(marked)
            if swap:
                self._swap_slow(t, swap)
                return
        target = self._resplit_target(self.base, marked, self.plan)
        if target is None or same_split(target, self.plan):
            return
        self.stretch.commit(self.res, t)
        self.res.resplits += 1
        self._start(self.base, target, t + self.costs.rebuild_s, replanned=False)

    def _resplit_target(self, base: Plan, marked: list[int], running: Plan) -> Plan | None:
        """The split the leader wants for `base` while `running` (a split of it) runs: re-split
        for the slow nodes while one is marked, if that is estimated at least
        `straggler_min_gain` faster than `running` (else None: no change); the planner's split
        once none is marked."""
        if not marked:
            return base
        tset = self.policy.tset
        result = resplit(tset, base, self.factors)
        if result.step_s > (1.0 - self.costs.straggler_min_gain) * slow_step_s(tset, running, self.factors):
            return None
        return result.plan

    def _spares_for(self, marked: list[int]) -> dict[int, int]:
        """Marked node -> the free spare that replaces it, if replacing them all is estimated to
        train more steps than rebalancing over `spare_payback_s` (their fetch included)."""
        assert self.base is not None
        free = [s for s in self.pool if self.factors.get(s, 1.0) < self.costs.straggler_threshold]
        swap = dict(zip(marked, free, strict=False))
        if not swap:
            return {}
        tset, net = self.policy.tset, self.costs.transfer_bytes_per_s(self.book.cluster)
        found, planning_s = self.policy.spare_swap(self.base, swap)
        fetch_s = planning_s + max(found.fetch_bytes.values(), default=0) / net
        left = [n for n in marked if n not in swap]
        after = self._resplit_target(found.plan, left, found.plan) if left else None
        with_spares = slow_step_s(tset, after or found.plan, self.factors)
        rebalance = self._resplit_target(self.base, marked, self.plan)
        rebalance_s = slow_step_s(tset, rebalance or self.plan, self.factors)
        payback = self.costs.spare_payback_s
        return swap if (payback - fetch_s) / with_spares > payback / rebalance_s else {}

    def _swap_slow(self, t: float, swap: dict[int, int]) -> None:
        """At step boundary `t`: each spare of `swap` takes its slow node's stage (fetching its
        shards, as on a failure); the slow nodes become spares, taken last."""
        assert self.base is not None
        self.stretch.commit(self.res, t)
        found, planning_s = self.policy.spare_swap(self.base, swap)
        fetch = max(found.fetch_bytes.values(), default=0)
        resume = t + planning_s + fetch / self.costs.transfer_bytes_per_s(self.book.cluster) + self.costs.rebuild_s
        for old, spare in swap.items():
            self.live.discard(old)
            self.live.add(spare)
            self.pool.remove(spare)
            self.pool.append(old)
            self.marks.drop(old)
        self._sort_pool()
        self.res.reconfigurations += 1
        self.res.slow_swaps += len(swap)
        left = sorted(n for n in self.marks.marked if n in found.plan.nodes)
        split = self._resplit_target(found.plan, left, found.plan) if left else None
        if split is not None and not same_split(split, found.plan):
            self.res.resplits += 1
        self._start(found.plan, split or found.plan, resume, replanned=True)
