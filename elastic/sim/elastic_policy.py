"""The elastic policy: this runtime (Oobleck-like), re-planning in place on every change."""

from __future__ import annotations

import dataclasses
import time

from elastic.planning.spares import substitute
from elastic.sim.config import RecoveryCosts
from elastic.sim.elastic_run import ElasticRun
from elastic.sim.planbook import PlanBook
from elastic.sim.result import PolicyResult
from elastic.sim.slowness import STRAGGLER_POLICIES
from elastic.sim.trace import Trace
from templates.plan import Plan
from templates.replanning import Replan, replan
from templates.template_set import PlanningError, TemplateSet


class ElasticPolicy:
    """Survivors keep running; the leader re-plans from the precomputed templates.

    Assumptions (also printed with the results):
    - t = 0: the fastest plan with >= f+1 pipelines over all N nodes (`instantiate`).
    - On a failure: detection takes the lease TTL for a lost host, or the node monitor's 5 ms when
      only its processes die (a Llama 3 `process` cause); both measured, bench/README.md "Failure
      detection" (`RecoveryCosts.detection_s`). Partial replay (elastic/sim/partial_replay.py, the
      runtime's elastic/records/partial.py): from `finish_from` (1/3) into the step on, the
      pipelines that lost no node finish their microbatches meanwhile, and the next plan's first
      step computes only the lost pipelines' microbatches (nothing committed is lost, and less
      than a step is redone); earlier, the whole step is replayed. Then
      `templates.replanning.replan` is called exactly as the leader calls it (fault tolerance
      relaxed from f towards 0 if needed) and its wall time is charged (or the fixed `replan_s`);
      every node fetches the layers it now needs (weights + AdamW state, `Replan.fetch_bytes`) in
      parallel at the measured transfer rate capped by its NIC, so transfer = the largest node's
      bytes / that rate; then the measured group/stage rebuild (bench/README.md "Recovery that
      loses less than a step"). A failure during a recovery or a replay step replays the whole step.
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
    - Slow nodes (trace events `slow` and `recover`; elastic/sim/slowness.py): a slow node's
      stage takes factor x its cost-model time, its pipeline's 1F1B time grows and a step takes
      the slowest pipeline's time. Straggler policy `off` does nothing about it. `rebalance`
      (the runtime's `--straggler-policy rebalance`): once the node is marked
      (elastic/sim/straggler_marks.py), at the next step boundary, the leader re-splits the
      global batch (`elastic.planning.stragglers.rebalanced`, the planner's 1F1B cost over the
      slowed stage times) if that is estimated at least `straggler_min_gain` faster, paying a
      group rebuild (`rebuild_s`) and nothing else: no transfer, no work lost; once no node is
      marked the planner's split comes back the same way. `auto`, as modelled here (spare or
      rebalance; the runtime's own `auto`, if any, may weigh more options and decide otherwise):
      first, a free spare (not slow itself) replaces the marked node (`substitute`) if, over
      `spare_payback_s`, that is estimated to train more steps than rebalancing; it fetches
      the node's stage as on a failure, and the slow node becomes a spare, taken last. A
      failure or join re-plans as without slow nodes; the survivors' slowness carries over.
    """

    def __init__(self, book: PlanBook, costs: RecoveryCosts, *, spares: int = 0, stragglers: str = "rebalance",
                 name: str = "elastic") -> None:
        if spares < 0:
            raise ValueError(f"--spares must be >= 0, got {spares}")
        if stragglers not in STRAGGLER_POLICIES:
            raise ValueError(f"--straggler-policy must be one of {', '.join(STRAGGLER_POLICIES)}, got {stragglers!r}")
        self.book = book
        self.costs = costs
        self.spares = spares
        self.stragglers = stragglers
        """What the leader does about slow nodes (elastic/sim/slowness.py STRAGGLER_POLICIES)."""
        self.name = name
        self.tset: TemplateSet = dataclasses.replace(book.elastic)
        """The leader's templates, whose stage times the slow nodes' factors multiply: a copy of
        the book's, so that its memory of instantiations (`TemplateSet.memo`) starts empty, as a
        leader's does, and a re-plan over a node count is charged the knapsack the first time."""

    def assumptions(self) -> list[str]:
        c, cl = self.costs, self.book.cluster
        return [
            f"in-place re-plan with the real planner (templates.replanning.replan), f = {cl.fault_tolerance} "
            "relaxed towards 0 only if no plan exists",
            f"failure: detection {c.detect_s:g} s for a lost host (lease TTL; bench/README.md \"Failure detection\": "
            f"lease expiry ~ the TTL) or {c.detect_process_s * 1e3:g} ms when only its processes die (a software cause; "
            "same section: the node monitor, median 5.3 ms)",
            ("partial replay (bench/README.md \"Recovery that loses less than a step\"; elastic/records/partial.py): "
             f"from {c.finish_from:.2g} of a step on, the pipelines that lost no node finish their microbatches "
             "during detection and the new plan's first step recomputes only the lost pipelines' share; earlier, "
             "the whole step is replayed; committed steps are never lost" if c.partial_replay else
             "whole-step replay (--whole-step-replay): the in-flight step is discarded"),
            "then the planner's wall time" + ("" if c.replan_s is None else f" (fixed at {c.replan_s:g} s)")
            + f" + transfer (largest per-node fetch of weights + AdamW state at {c.transfer_text(cl)}) "
            f"+ rebuild {c.rebuild_s:g} s (measured: bench/README.md \"Recovery that loses less than a step\", "
            "the largest rebuild there, 4 CPU nodes on gloo)",
            "join: at the next step boundary (the in-flight step completes), then the same without detection",
            "no plan possible (or a layer without holder): checkpoint fallback not modelled, the run stalls",
            *([f"{self.spares} hot spare(s): a failure takes a spare in in the same re-plan (it fetches the lost "
               "node's shards); a returning node becomes a spare while the plan has all its nodes"]
              if self.spares else []),
        ]

    def straggler_assumptions(self) -> list[str]:
        c = self.costs
        if self.stragglers == "off":
            return ["stragglers off: a slow node's stage takes factor x its cost-model time and every step waits "
                    "for the slowest pipeline; nothing is done about it"]
        lines = [
            f"stragglers {self.stragglers}: a node is marked {c.straggler_detect_steps} steps (at the pace of its "
            f"slowdown) after it slows by >= {c.straggler_threshold:g}x, its mark clears as long after it recovers "
            "(the runtime's StragglerConfig: 10 steps of a 5-step median); a re-plan restarts the count, and a "
            f"node still marked in the new plan is re-split for after {c.straggler_window_steps} steps",
            f"at the next step boundary the global batch is re-split for the slowed stage times (rebalanced, the "
            f"planner's 1F1B cost) if estimated >= {c.straggler_min_gain:.0%} faster; a re-split costs the rebuild "
            f"{c.rebuild_s:g} s (rebuild_s), no transfer, no work lost; with no mark left the planner's split "
            "comes back the same way",
        ]
        if self.stragglers == "auto":
            lines.append(
                "auto (this model's rule: spare or rebalance, nothing else): a free spare that is not slow replaces a marked node (substitute) "
                f"if over {c.spare_payback_s:g} s it trains more steps than rebalancing; it fetches the node's stage "
                "as on a failure, plus rebuild; the slow node becomes a spare, taken last"
            )
        return lines

    def run(self, trace: Trace, horizon_s: float) -> PolicyResult:
        slow = trace.until(horizon_s).slowdowns > 0
        assumptions = self.assumptions() + (self.straggler_assumptions() if slow else [])
        run = ElasticRun(self, initial_nodes=trace.initial_nodes, assumptions=assumptions)
        for ev in trace.until(horizon_s).events:
            run.act_until(ev.time_s)
            run.on_event(ev, horizon_s)
        run.act_until(horizon_s)
        return run.finish(horizon_s)

    def spare_event(self, event: str, node: int, live: set[int], pool: list[int], res: PolicyResult) -> bool:
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

    def spare_swap(self, plan: Plan, swap: dict[int, int]) -> tuple[Replan, float]:
        """The leader's re-plan when spares replace every lost node (elastic/planning/spares.py):
        the same instantiation, each spare fetching the whole stage of the node it replaces."""
        start = time.perf_counter()
        new = substitute(plan, swap)
        fetch = {spare: self.book.stage_bytes(st)
                 for pipe in plan.pipelines for st in pipe.stages for old, spare in swap.items() if st.node == old}
        measured = time.perf_counter() - start
        found = Replan(plan=new, fetch_bytes=fetch, strategy="spare", gpus_per_node=plan.gpus_per_node)
        return found, measured if self.costs.replan_s is None else self.costs.replan_s

    def replan_over(self, plan: Plan, live: list[int]) -> tuple[Replan | None, float]:
        start = time.perf_counter()
        found: Replan | None = None
        for f in range(self.book.f, -1, -1):
            try:
                found = replan(self.tset, plan, live, global_microbatches=self.book.mbs, fault_tolerance=f)
                break
            except PlanningError:
                continue
        measured = time.perf_counter() - start
        return found, measured if self.costs.replan_s is None else self.costs.replan_s

