"""The simulator's hot spares (`elastic simulate --spares K`, ElasticPolicy(spares=K)) against
the planner called directly: a failure takes a spare in at the cost of its shard fetch and the
job keeps its plan's size, a returning node becomes a spare at no cost, and with no spare left a
failure is handled exactly as without spares."""

from __future__ import annotations

import math

import pytest

from elastic.planning.cluster import ClusterSpec, cluster_profile
from elastic.sim.config import RecoveryCosts
from elastic.sim.planbook import PlanBook
from elastic.sim.simulate import run_policy, simulate
from elastic.sim.trace import Trace, TraceEvent
from templates.instantiation import instantiate
from templates.replanning import replan

pytestmark = pytest.mark.timeout(120)

CLUSTER = ClusterSpec(model="gpt3-350m", nodes=8, fault_tolerance=1, global_batch=32, microbatch=1, device_memory_gib=16.0)
COSTS = RecoveryCosts(replan_s=0.05, checkpoint_interval_s=120.0, partial_replay=False, transfer_gbps=None)
HORIZON = 3600.0


@pytest.fixture(scope="module")
def book() -> PlanBook:
    return PlanBook(CLUSTER, cluster_profile(CLUSTER), redundant_forward=COSTS.redundant_forward)


def trace(*events: tuple[float, str, int]) -> Trace:
    return Trace(initial_nodes=CLUSTER.nodes,
                 events=tuple(TraceEvent(time_s=t, event=e, node=n) for t, e, n in events))  # type: ignore[arg-type]


def test_a_failure_takes_a_spare_in_at_the_cost_of_its_shard_fetch(book: PlanBook) -> None:
    res = run_policy("elastic", book, COSTS, trace((300.0, "fail", 3)), HORIZON, spares=1)
    first = instantiate(book.elastic, list(range(8)), global_microbatches=32, fault_tolerance=1)
    # Node 8 (the spare) takes node 3's stage: it fetches exactly that stage's layers (weights +
    # AdamW state), from the planner's own profile.
    (stage,) = [st for pipe in first.pipelines for st in pipe.stages if st.node == 3]
    fetch = sum(book.profile.layer_bytes(i) for i in range(*stage.layers))
    assert fetch > 0
    resume = 300.0 + COSTS.detect_s + 0.05 + fetch / CLUSTER.network_bytes_per_s + COSTS.rebuild_s
    assert res.segments[1].start_s == pytest.approx(resume)
    assert [(s.live, s.used, s.pipelines) for s in res.segments] == [(8, 8, len(first.pipelines))] * 2
    it = first.iteration_time
    assert res.segments[1].iteration_s == it
    # Cheaper than the planner's re-plan over the same nodes would be, and never slower.
    moved = replan(book.elastic, first, [0, 1, 2, 4, 5, 6, 7, 8], global_microbatches=32, fault_tolerance=1)
    assert fetch <= max(moved.fetch_bytes.values()) and it <= moved.plan.iteration_time * 1.05
    assert res.steps == math.floor(300.0 / it + 1e-9) + math.floor((HORIZON - resume) / it + 1e-9)
    assert res.spares_taken == 1 and res.reconfigurations == 1


def test_a_spare_beats_running_degraded_on_the_same_trace(book: PlanBook) -> None:
    t = trace((300.0, "fail", 3), (900.0, "join", 3), (1500.0, "fail", 5), (2100.0, "join", 5))
    without = run_policy("elastic", book, COSTS, t, HORIZON)
    spare = run_policy("elastic", book, COSTS, t, HORIZON, spares=1)
    assert spare.samples > without.samples
    # Each returning node becomes the spare (no re-plan), and the second failure takes it in.
    assert spare.reconfigurations == 2 and without.reconfigurations == 4
    assert spare.spares_taken == 2 and spare.joins == 2 and spare.failures == 2
    assert all(s.live == 8 for s in spare.segments)


def test_with_no_spare_left_a_failure_runs_degraded_as_without_spares(book: PlanBook) -> None:
    res = run_policy("elastic", book, COSTS, trace((300.0, "fail", 3), (900.0, "fail", 6)), HORIZON, spares=1)
    assert [s.live for s in res.segments] == [8, 8, 7]
    assert res.spares_taken == 1
    # Zero spares is exactly the policy without them.
    t = trace((300.0, "fail", 3), (900.0, "join", 3))
    assert run_policy("elastic", book, COSTS, t, HORIZON, spares=0).to_dict() == \
        run_policy("elastic", book, COSTS, t, HORIZON).to_dict()


def test_a_failed_spare_costs_nothing(book: PlanBook) -> None:
    # Node 3 fails (spare 8 taken in), comes back as the spare, then fails again while a spare.
    res = run_policy("elastic", book, COSTS, trace((300.0, "fail", 3), (900.0, "join", 3), (1200.0, "fail", 3)),
                     HORIZON, spares=1)
    assert res.reconfigurations == 1 and res.failures == 2 and len(res.segments) == 2


def test_the_report_names_the_spares() -> None:
    report = simulate(CLUSTER, COSTS, trace((300.0, "fail", 3)), horizon_s=HORIZON, policies=("elastic",), spares=2)
    assert report["spares"] == 2 and report["policies"][0]["spares_taken"] == 1
    with pytest.raises(ValueError, match="spares"):
        simulate(CLUSTER, COSTS, trace(), horizon_s=HORIZON, policies=("elastic",), spares=-1)
