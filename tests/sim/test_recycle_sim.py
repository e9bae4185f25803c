"""The ReCycle-like policy against the planner's cost model, worked by hand.

GPT-3 350M on 8 nodes of 16 GiB devices: the homogeneous plan is 4 pipelines of 2 nodes, 8
microbatches each (checked below), so the cases are small enough to write out.
"""

from __future__ import annotations

import math

import pytest

from elastic.planning.cluster import ClusterSpec, cluster_profile
from elastic.sim.config import RecoveryCosts
from elastic.sim.planbook import PlanBook
from elastic.sim.recycle_policy import RecyclePolicy
from elastic.sim.reroute import reroute_extra
from elastic.sim.simulate import run_policy
from elastic.sim.trace import Trace, TraceEvent

pytestmark = pytest.mark.timeout(120)

CLUSTER = ClusterSpec(model="gpt3-350m", nodes=8, fault_tolerance=1, global_batch=32, microbatch=1, device_memory_gib=16.0)
COSTS = RecoveryCosts(replan_s=0.05)
HORIZON = 3600.0


@pytest.fixture(scope="module")
def book() -> PlanBook:
    return PlanBook(CLUSTER, cluster_profile(CLUSTER), redundant_forward=COSTS.redundant_forward)


@pytest.fixture(scope="module")
def stage_times(book: PlanBook) -> tuple[float, float]:
    """(t0, t1): the 2-node template's stage times, the cost model's seconds a microbatch."""
    plan = book.shape_plan("flat", list(range(8)))
    assert plan is not None
    assert [(p.nodes, p.microbatches) for p in plan.pipelines] == [((0, 1), 8), ((2, 3), 8), ((4, 5), 8), ((6, 7), 8)]
    t0, t1 = book.flat.template(2).stage_times
    assert t1 > t0  # the head's stage is the slower one
    return t0, t1


def events(*items: tuple[float, str, int]) -> Trace:
    return Trace(initial_nodes=8, events=tuple(TraceEvent(time_s=t, event=e, node=n) for t, e, n in items))


def test_no_failure_is_the_failure_free_homogeneous_plan(book: PlanBook, stage_times: tuple[float, float]) -> None:
    t0, t1 = stage_times
    step = t0 + t1 + (8 - 1) * t1  # templates.cost.pipeline_time for 8 microbatches
    shape = book.shape("flat", 8)
    assert shape is not None and shape.iteration_time == pytest.approx(step)
    res = run_policy("recycle", book, COSTS, events(), HORIZON)
    assert res.steps == math.floor(HORIZON / step + 1e-9)
    assert res.lost_s == 0.0 and res.reconfigurations == 0 and res.recovery_s == pytest.approx(0.0, abs=1e-6)


def test_rerouted_microbatches_go_to_the_least_loaded_peers() -> None:
    assert reroute_extra([8, 8, 8, 8], [1]) == {0: 3, 2: 3, 3: 2}  # 8 over 3 peers
    assert reroute_extra([9, 8, 8], [0]) == {1: 5, 2: 4}
    assert reroute_extra([8, 8], [0, 1]) is None


@pytest.mark.parametrize("hidden", [0.0, 0.5, 1.0])
def test_one_failure_sets_the_step_by_the_most_loaded_stage(book: PlanBook, stage_times: tuple[float, float],
                                                           hidden: float) -> None:
    """Node 3 (stage 1 of pipeline 1) fails: its 8 microbatches of stage 1 go to pipelines 0, 2
    and 3 (3, 3 and 2 more). Pipeline 0's stage 1 then runs 11 microbatches; a share `hidden`
    of the 3 extra goes into its bubble, which in 1F1B is stage 0's time t0."""
    t0, t1 = stage_times
    costs = RecoveryCosts(replan_s=0.05, recycle_hidden=hidden)
    fail_at = 600.0
    res = RecyclePolicy(book, costs).run(events((fail_at, "fail", 3)), HORIZON)
    before = t0 + t1 + 7 * t1
    shown = 3 * t1 - min(hidden * 3 * t1, t0)
    expected = t0 + t1 + 7 * t1 + shown
    assert [s.iteration_s for s in res.segments] == pytest.approx([before, expected])
    resume = fail_at + costs.detect_s + costs.rebuild_s  # no re-plan, no transfer
    assert res.segments[1].start_s == pytest.approx(resume)
    done = math.floor(fail_at / before + 1e-9)
    assert res.lost_s == pytest.approx(fail_at - done * before)  # the in-flight step
    assert res.steps == done + math.floor((HORIZON - resume) / expected + 1e-9)
    assert res.segments[1].used == 7 and res.reconfigurations == 1


def test_a_join_takes_the_failed_place_back(book: PlanBook, stage_times: tuple[float, float]) -> None:
    t0, t1 = stage_times
    res = RecyclePolicy(book, COSTS).run(events((600.0, "fail", 3), (1200.0, "join", 3)), HORIZON)
    degraded = res.segments[1]
    boundary = degraded.start_s + math.ceil((1200.0 - degraded.start_s) / degraded.iteration_s - 1e-9) * \
        degraded.iteration_s
    stage1 = sum(book.profile.layer_bytes(i) for i in range(*book.flat.template(2).stages[1]))
    resume = boundary + stage1 / COSTS.transfer_bytes_per_s(CLUSTER) + COSTS.rebuild_s
    assert res.segments[2].start_s == pytest.approx(resume)
    assert res.segments[2].iteration_s == pytest.approx(t0 + t1 + 7 * t1)
    assert res.joins == 1 and res.reconfigurations == 2


def test_a_stage_without_nodes_stalls(book: PlanBook) -> None:
    """Nodes 1, 3, 5, 7 run stage 1 of the four pipelines."""
    trace = events((100.0, "fail", 1), (200.0, "fail", 3), (300.0, "fail", 5), (400.0, "fail", 7))
    res = RecyclePolicy(book, COSTS).run(trace, HORIZON)
    assert res.stalled_at == 400.0
    survives = RecyclePolicy(book, COSTS).run(events((100.0, "fail", 1), (200.0, "fail", 3), (300.0, "fail", 5)),
                                              HORIZON)
    assert survives.stalled_at is None


def test_a_failed_idle_node_costs_nothing() -> None:
    """7 nodes: 3 pipelines of 2, node 6 idles."""
    cluster = ClusterSpec(model="gpt3-350m", nodes=7, fault_tolerance=1, global_batch=32, microbatch=1,
                          device_memory_gib=16.0)
    book7 = PlanBook(cluster, cluster_profile(cluster), redundant_forward=1.0)
    trace = Trace(initial_nodes=7, events=(TraceEvent(time_s=100.0, event="fail", node=6),))
    res = RecyclePolicy(book7, COSTS).run(trace, HORIZON)
    clean = RecyclePolicy(book7, COSTS).run(Trace(initial_nodes=7), HORIZON)
    assert res.steps == clean.steps and res.failures == 1 and res.reconfigurations == 0


def test_cached_homogeneous_plans_are_build_plans(book: PlanBook) -> None:
    """The plan book reuses a node count's split over other node ids: the same as `build_plan`."""
    from templates.instantiation import build_plan

    for nodes in ([0, 1, 2, 3, 4, 5, 6, 7], [0, 2, 3, 4, 5, 6, 7, 9], [1, 2, 3, 5, 8, 11, 12]):
        for _ in range(2):  # the first call fills the cache, the second reuses it
            plan = book.shape_plan("flat", nodes)
            shape = book.shape("flat", len(nodes))
            assert plan is not None and shape is not None
            groups = [sorted(nodes)[p * shape.depth : (p + 1) * shape.depth] for p in range(shape.pipelines)]
            assert plan == build_plan(book.flat, groups, global_microbatches=32, fault_tolerance=0)
