"""The elastic policy: this runtime (Oobleck-like), re-planning in place on every change."""

from __future__ import annotations

import math
import time

from elastic.planning.spares import substitute
from elastic.sim.config import RecoveryCosts
from elastic.sim.planbook import PlanBook
from elastic.sim.result import PolicyResult, segment_of, train_interrupted, whole_steps
from elastic.sim.trace import Trace
from templates.plan import Plan
from templates.replanning import Replan, replan
from templates.template_set import PlanningError


class ElasticPolicy:
    """Survivors keep running; the leader re-plans from the precomputed templates.

    Assumptions (also printed with the results):
    - t = 0: the fastest plan with >= f+1 pipelines over all N nodes (`instantiate`).
    - On a failure: detection takes the lease TTL; then `templates.replanning.replan` is called
      exactly as the leader calls it (fault tolerance relaxed from f towards 0 if needed) and
      its wall time is charged (or the fixed `replan_s`); every node fetches the layers it now
      needs (weights + AdamW state, `Replan.fetch_bytes`) over its own NIC, in parallel, from
      sources that are not a bottleneck, so transfer = the largest node's bytes / bandwidth;
      then a fixed group/stage rebuild; the in-flight step is discarded (its partial work lost).
    - A join waits for the in-flight step to commit (the runtime takes newcomers in at a step
      boundary, so no work is lost), then costs the same as a failure without detection. (A
      failure inside that last step is charged as if the step had completed: a small overcount.)
    - A change during a recovery abandons that recovery and starts a new one from the plan
      being recovered to.
    - Throughput = global batch / the plan's iteration time from the planner's cost model.
    - If no plan fits or a layer lost every holder, the runtime would restore a checkpoint;
      that path is not modelled here: the run stalls (trains nothing more) and says so.
    - Hot spares (`spares` K > 0, `elastic run --spares`, elastic/planning/spares.py): K nodes
      beside the trace's N are up, holding nothing. A failure of a training node takes the
      lowest-numbered spare in, in the same re-plan (so the plan keeps N nodes and the spare
      pays the shard fetch of the node it replaces, instead of the job running degraded); a
      node that comes back while N nodes train becomes a spare at no cost; a spare's own
      failure costs nothing. With no spare left, a failure is handled as without spares.
    """

    name = "elastic"

    def __init__(self, book: PlanBook, costs: RecoveryCosts, *, spares: int = 0) -> None:
        if spares < 0:
            raise ValueError(f"--spares must be >= 0, got {spares}")
        self.book = book
        self.costs = costs
        self.spares = spares

    def assumptions(self) -> list[str]:
        c, cl = self.costs, self.book.cluster
        return [
            f"in-place re-plan with the real planner (templates.replanning.replan), f = {cl.fault_tolerance} "
            "relaxed towards 0 only if no plan exists",
            f"failure: detection {c.detect_s:g} s (lease TTL) + planner wall time"
            + ("" if c.replan_s is None else f" fixed at {c.replan_s:g} s")
            + f" + transfer (largest per-node fetch of weights + AdamW state / {cl.network_gbps:g} Gbit/s) "
            f"+ rebuild {c.rebuild_s:g} s; the in-flight step is discarded",
            "join: at the next step boundary (the in-flight step completes), then the same without detection",
            "no plan possible (or a layer without holder): checkpoint fallback not modelled, the run stalls",
            *([f"{self.spares} hot spare(s): a failure takes a spare in in the same re-plan (it fetches the lost "
               "node's shards); a returning node becomes a spare while the plan has all its nodes"]
              if self.spares else []),
        ]

    def run(self, trace: Trace, horizon_s: float) -> PolicyResult:
        book, costs = self.book, self.costs
        res = PolicyResult(policy=self.name, assumptions=self.assumptions())
        first = book.initial_plan()
        plan: Plan | None = first
        live = set(range(trace.initial_nodes))
        pool = list(range(trace.initial_nodes, trace.initial_nodes + self.spares))
        """The spares: up, in no plan (elastic/planning/spares.py)."""
        resume = 0.0
        res.segments.append(segment_of(0.0, len(live), first))
        for ev in trace.until(horizon_s).events:
            t = ev.time_s
            if self._spare_event(ev.event, ev.node, live, pool, res):
                continue  # a spare lost, or a node back as a spare: the plan is untouched
            if ev.event == "join" and plan is not None and t > resume:
                it = plan.iteration_time
                t = min(horizon_s, resume + math.ceil((t - resume) / it - 1e-9) * it)  # the step boundary
            if plan is not None and t > resume:
                train_interrupted(res, t - resume, plan.iteration_time)
            swap: dict[int, int] = {}
            if ev.event == "fail":
                live.discard(ev.node)
                res.failures += 1
                if pool and plan is not None and ev.node in plan.nodes:  # the re-plan takes a spare in
                    swap[ev.node] = pool.pop(0)
                    live.add(swap[ev.node])
                    res.spares_taken += 1
            else:
                live.add(ev.node)
                res.joins += 1
            if plan is None:
                continue
            new, planning_s = self._spare_swap(plan, swap) if swap else self._replan(plan, sorted(live))
            if new is None:
                res.stalled_at = t
                plan = None
                continue
            fetch = max(new.fetch_bytes.values(), default=0)
            cost = planning_s + fetch / book.cluster.network_bytes_per_s + costs.rebuild_s
            if ev.event == "fail":
                cost += costs.detect_s
            resume = t + cost
            plan = new.plan
            res.reconfigurations += 1
            res.segments.append(segment_of(resume, len(live), plan))
        if plan is not None and horizon_s > resume:
            ran = horizon_s - resume
            res.steps += whole_steps(ran, plan.iteration_time)
            res.training_s += ran
        res.samples = res.steps * book.cluster.global_batch
        res.recovery_s = horizon_s - res.training_s - res.checkpoint_s
        return res

    def _spare_event(self, event: str, node: int, live: set[int], pool: list[int], res: PolicyResult) -> bool:
        """Handle an event that touches only the spares (True): a spare's failure, or a node that
        comes back while the plan has all its nodes (it becomes a spare)."""
        if event == "fail" and node in pool:
            pool.remove(node)
            res.failures += 1
            return True
        if event == "join" and self.spares and len(live) >= self.book.cluster.nodes:
            pool.append(node)
            pool.sort()
            res.joins += 1
            return True
        return False

    def _spare_swap(self, plan: Plan, swap: dict[int, int]) -> tuple[Replan, float]:
        """The leader's re-plan when spares replace every lost node (elastic/planning/spares.py):
        the same instantiation, each spare fetching the whole stage of the node it replaces."""
        start = time.perf_counter()
        new = substitute(plan, swap)
        profile = self.book.profile
        fetch = {spare: sum(profile.layer_bytes(i) for i in range(*st.layers))
                 for pipe in plan.pipelines for st in pipe.stages for old, spare in swap.items() if st.node == old}
        measured = time.perf_counter() - start
        found = Replan(plan=new, fetch_bytes=fetch, strategy="spare", gpus_per_node=plan.gpus_per_node)
        return found, measured if self.costs.replan_s is None else self.costs.replan_s

    def _replan(self, plan: Plan, live: list[int]) -> tuple[Replan | None, float]:
        start = time.perf_counter()
        found: Replan | None = None
        for f in range(self.book.f, -1, -1):
            try:
                found = replan(self.book.elastic, plan, live, global_microbatches=self.book.mbs, fault_tolerance=f)
                break
            except PlanningError:
                continue
        measured = time.perf_counter() - start
        return found, measured if self.costs.replan_s is None else self.costs.replan_s

