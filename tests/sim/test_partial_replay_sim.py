"""The elastic policy's recovery is today's runtime's: partial replay, the measured detection,
rebuild and transfer. References: the runtime's own rule and spread (elastic/records/partial.py),
the planner called directly, and the cost model's 1F1B formula.

GPT-3 350M on 8 nodes of 16 GiB devices: 4 pipelines of 2 nodes, 8 microbatches each.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from elastic.planning.cluster import ClusterSpec, cluster_profile
from elastic.planning.stragglers import template_stage_times
from elastic.records.partial import FINISH_FROM, split_microbatches
from elastic.sim.config import RecoveryCosts
from elastic.sim.planbook import PlanBook
from elastic.sim.simulate import run_policy, simulate
from elastic.sim.trace import Trace, TraceEvent
from elastic.sim.trace_arg import trace_from_arg
from templates.cost import pipeline_time
from templates.replanning import replan

pytestmark = pytest.mark.timeout(120)

CLUSTER = ClusterSpec(model="gpt3-350m", nodes=8, fault_tolerance=1, global_batch=32, microbatch=1, device_memory_gib=16.0)
REPLAN_S = 0.05
COSTS = RecoveryCosts(replan_s=REPLAN_S)
HORIZON = 3600.0


@pytest.fixture(scope="module")
def book() -> PlanBook:
    return PlanBook(CLUSTER, cluster_profile(CLUSTER), redundant_forward=COSTS.redundant_forward)


def fail_at(t: float, node: int, cause: str | None = None) -> Trace:
    return Trace(initial_nodes=8, events=(TraceEvent(time_s=t, event="fail", node=node, cause=cause),))


def test_the_figures_are_the_runtimes() -> None:
    assert COSTS.finish_from == FINISH_FROM
    assert COSTS.partial_replay


def test_the_spread_is_the_runtimes(book: PlanBook) -> None:
    """The simulator charges `Plan.spread`, which the runtime's split uses; checked here against
    the definition: every microbatch once, each pipeline within one of its exact proportion."""
    plan = book.initial_plan()
    total = plan.global_microbatches
    for count in range(0, 33):
        sizes = plan.spread(count)
        assert sizes == [len(s) for s in split_microbatches(plan, list(range(count)))]
        assert sum(sizes) == count
        assert all(abs(size - count * p.microbatches / total) < 1 for size, p in zip(sizes, plan.pipelines, strict=True))


def _expected(book: PlanBook, fraction: float) -> tuple[float, float, float, int]:
    """(failure time, resume, replay seconds, steps before) for node 2 failing `fraction` into a step."""
    first = book.initial_plan()
    step = first.iteration_time
    before = 100
    t = (before + fraction) * step
    new = replan(book.elastic, first, [n for n in range(8) if n != 2], global_microbatches=32, fault_tolerance=1)
    lost = next(p.microbatches for p in first.pipelines if 2 in p.nodes)
    times = template_stage_times(book.elastic, new.plan)
    replay = max(pipeline_time([times[s.node] for s in pipe.stages], m)
                 for pipe, m in zip(new.plan.pipelines, new.plan.spread(lost), strict=True) if m)
    fetch = max(new.fetch_bytes.values(), default=0) / COSTS.transfer_bytes_per_s(CLUSTER)
    wait = max(COSTS.detect_s, (1 - fraction) * step) if fraction >= FINISH_FROM else COSTS.detect_s
    return t, t + wait + REPLAN_S + fetch + COSTS.rebuild_s, replay, before


def test_late_failure_replays_only_the_lost_pipeline(book: PlanBook) -> None:
    """At 0.9 of a step: the intact pipelines finish, the new plan recomputes node 2's pipeline's
    8 microbatches, and the interrupted step commits after that replay: less than a step lost."""
    t, resume, replay, before = _expected(book, 0.9)
    res = run_policy("elastic", book, COSTS, fail_at(t, 2), HORIZON)
    after = res.segments[1]
    assert after.start_s == pytest.approx(resume)
    assert res.lost_s == pytest.approx(replay)
    assert replay < after.iteration_s and replay < book.initial_plan().iteration_time
    # The interrupted step commits at resume + replay, then steps at the new plan's pace.
    assert res.steps == before + 1 + math.floor((HORIZON - resume - replay) / after.iteration_s + 1e-9)
    whole = run_policy("elastic", book, RecoveryCosts(replan_s=REPLAN_S, partial_replay=False), fail_at(t, 2), HORIZON)
    assert whole.lost_s == pytest.approx(0.9 * book.initial_plan().iteration_time)
    assert res.lost_s < whole.lost_s


def test_early_failure_replays_the_whole_step(book: PlanBook) -> None:
    t, resume, _, before = _expected(book, 0.2)
    res = run_policy("elastic", book, COSTS, fail_at(t, 2), HORIZON)
    assert res.segments[1].start_s == pytest.approx(resume)
    assert res.lost_s == pytest.approx(0.2 * book.initial_plan().iteration_time)
    assert res.steps == before + math.floor((HORIZON - resume) / res.segments[1].iteration_s + 1e-9)


def test_a_software_cause_is_seen_by_the_node_monitor(book: PlanBook) -> None:
    t, resume, _, _ = _expected(book, 0.2)
    res = run_policy("elastic", book, COSTS, fail_at(t, 2, cause="Software bug"), HORIZON)
    assert res.segments[1].start_s == pytest.approx(resume - COSTS.detect_s + COSTS.detect_process_s)
    assert COSTS.detect_process_s < 0.01 < COSTS.detect_s


def test_a_failure_during_the_replay_loses_what_the_replay_ran(book: PlanBook) -> None:
    t, resume, replay, _ = _expected(book, 0.9)
    second = resume + replay / 2
    trace = Trace(initial_nodes=8, events=(TraceEvent(time_s=t, event="fail", node=2),
                                           TraceEvent(time_s=second, event="fail", node=5)))
    res = run_policy("elastic", book, COSTS, trace, HORIZON)
    assert res.lost_s == pytest.approx(replay / 2)  # then the whole step is replayed: nothing else lost


def test_lost_work_is_under_a_step_per_failure_on_a_llama3_trace(book: PlanBook) -> None:
    """Many failures at every point of the step (rejoins too): partial replay loses less than a
    step per failure, and no more than replaying the whole step does."""
    trace = trace_from_arg("llama3,seed=1,repair=20m,restart=5m", initial_nodes=8, gpus_per_node=20_000,
                           horizon_s=12 * 3600.0)
    assert trace.failures >= 10
    part = run_policy("elastic", book, COSTS, trace, 12 * 3600.0)
    whole = run_policy("elastic", book, RecoveryCosts(replan_s=REPLAN_S, partial_replay=False), trace, 12 * 3600.0)
    slowest = max(s.iteration_s for s in part.segments)
    assert part.lost_s < part.failures * slowest
    assert part.lost_s < whole.lost_s
    assert part.steps >= whole.steps


def test_one_seed_one_report(book: PlanBook) -> None:
    def report() -> dict[str, Any]:
        trace = trace_from_arg("llama3,seed=4,repair=3h", initial_nodes=8, gpus_per_node=2000, horizon_s=6 * 3600.0)
        return simulate(CLUSTER, COSTS, trace, horizon_s=6 * 3600.0)

    first = report()
    assert first == report()
    tr = first["trace"]
    assert isinstance(tr, dict) and sum(tr["causes"].values()) == tr["failures"] > 0
    assert [p["policy"] for p in first["policies"]] == ["elastic", "checkpoint-restart", "redundant", "recycle"]
