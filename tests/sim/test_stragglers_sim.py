"""Slow nodes in the simulator against references computed here from the planner's own pieces.

GPT-3 350M on 4 nodes of 16 GiB devices, f = 1: the planner's plan is 2 pipelines of 2 nodes,
16 microbatches each; node 1 runs stage 1 of pipeline 0. Times come from the 2-node template's
stage times and the 1F1B formula (`templates.cost.pipeline_time`), the split from
`elastic.planning.stragglers.rebalanced`; the mark comes 12 steps after a slowdown, then the next
step boundary (the runtime's StragglerConfig: 10 steps of a 5-step median). Failures need more
nodes (4 leave no plan for 3): those tests take the same model on 8 nodes, and the checkpoint
policy is checked against a step-by-step replay written here.
"""

from __future__ import annotations

import json
import math

import pytest

from elastic.cli.main import main
from elastic.planning.cluster import ClusterSpec, cluster_profile
from elastic.planning.spares import substitute
from elastic.planning.stragglers import rebalanced
from elastic.sim.checkpoint_policy import CheckpointRestartPolicy
from elastic.sim.config import RecoveryCosts
from elastic.sim.planbook import PlanBook
from elastic.sim.redundant_policy import RedundantPolicy
from elastic.sim.result import PolicyResult
from elastic.sim.simulate import STRAGGLERS_OFF, references, run_policy, simulate
from elastic.sim.trace import Trace, TraceEvent
from templates.cost import pipeline_time
from templates.plan import Plan
from templates.replanning import replan

pytestmark = pytest.mark.timeout(120)

CLUSTER = ClusterSpec(model="gpt3-350m", nodes=4, fault_tolerance=1, global_batch=32, microbatch=1, device_memory_gib=16.0)
CLUSTER8 = ClusterSpec(model="gpt3-350m", nodes=8, fault_tolerance=1, global_batch=32, microbatch=1,
                       device_memory_gib=16.0)
COSTS = RecoveryCosts(replan_s=0.05, partial_replay=False, transfer_gbps=None)
HORIZON = 3600.0
SLOW_AT = 600.0
DETECT = 12


@pytest.fixture(scope="module")
def book() -> PlanBook:
    return PlanBook(CLUSTER, cluster_profile(CLUSTER), redundant_forward=COSTS.redundant_forward)


@pytest.fixture(scope="module")
def plan(book: PlanBook) -> Plan:
    plan = book.initial_plan()
    assert [(p.nodes, p.microbatches) for p in plan.pipelines] == [((0, 1), 16), ((2, 3), 16)]
    return plan


@pytest.fixture(scope="module")
def book8() -> PlanBook:
    """8 nodes: templates of 2 to 6 nodes, so a failure leaves a plan (4 nodes leave none for 3)."""
    return PlanBook(CLUSTER8, cluster_profile(CLUSTER8), redundant_forward=COSTS.redundant_forward)


def trace(*events: tuple[float, str, int, float | None], nodes: int = 4) -> Trace:
    return Trace(initial_nodes=nodes,
                 events=tuple(TraceEvent(time_s=t, event=e, node=n, factor=f) for t, e, n, f in events))


def trace8(*events: tuple[float, str, int, float | None]) -> Trace:
    return trace(*events, nodes=8)


def stage_times(book: PlanBook) -> tuple[float, float]:
    s0, s1 = book.elastic.template(2).stage_times
    return s0, s1


def run(book: PlanBook, t: Trace, stragglers: str, spares: int = 0) -> PolicyResult:
    return run_policy("elastic", book, COSTS, t, HORIZON, spares=spares, stragglers=stragglers)


def mark_boundary(steps_before: float, slow_s: float, at: float) -> tuple[int, float]:
    """(whole steps done by, time of) the first step boundary after the mark, when the pace
    became `slow_s` at time `at` with `steps_before` steps (a fraction) done."""
    steps = math.ceil(steps_before + DETECT - 1e-9)
    return steps, at + (steps - steps_before) * slow_s


def test_the_detection_delay_is_the_runtimes() -> None:
    assert COSTS.straggler_detect_steps == DETECT == 10 + 5 // 2
    assert COSTS.straggler_threshold == 1.25


def test_off_runs_at_the_slow_pipelines_pace(book: PlanBook, plan: Plan) -> None:
    s0, s1 = stage_times(book)
    full = pipeline_time([s0, s1], 16)
    slow = pipeline_time([s0, 2 * s1], 16)  # pipeline 0 with node 1 at 2x; pipeline 1 is faster
    assert plan.iteration_time == full < slow < 2 * full
    res = run(book, trace((SLOW_AT, "slow", 1, 2.0)), "off")
    assert [(s.start_s, s.iteration_s) for s in res.segments] == [(0.0, full), (SLOW_AT, slow)]
    # The step in flight at the slowdown finishes at the slow pace: nothing is lost.
    assert res.steps == math.floor(SLOW_AT / full + (HORIZON - SLOW_AT) / slow + 1e-9)
    assert res.lost_s == 0.0 and res.resplits == 0 and res.reconfigurations == 0


def test_rebalance_runs_at_the_rebalanced_estimate_after_the_mark(book: PlanBook, plan: Plan) -> None:
    s0, s1 = stage_times(book)
    full, slow = plan.iteration_time, pipeline_time([s0, 2 * s1], 16)
    expected = rebalanced(plan, {0: s0, 1: 2 * s1, 2: s0, 3: s1})
    assert [p.microbatches for p in expected.plan.pipelines] == [10, 22]
    assert expected.unchanged_s == pytest.approx(slow) and full < expected.step_s < slow
    t = trace((SLOW_AT, "slow", 1, 2.0))
    res = run(book, t, "rebalance")
    done, boundary = mark_boundary(SLOW_AT / full, slow, SLOW_AT)
    resume = boundary + COSTS.rebuild_s  # a re-split: a group rebuild, nothing fetched
    assert [s.iteration_s for s in res.segments] == pytest.approx([full, slow, expected.step_s])
    assert res.segments[-1].start_s == pytest.approx(resume)
    assert res.steps == done + math.floor((HORIZON - resume) / expected.step_s + 1e-9)
    assert res.resplits == 1 and res.reconfigurations == 0 and res.lost_s == 0.0
    off = run(book, t, "off")
    free = references(book, t, HORIZON).failure_free_samples
    assert off.samples < res.samples < free


def test_recovery_brings_the_planners_split_back(book: PlanBook, plan: Plan) -> None:
    s0, s1 = stage_times(book)
    full, slow = plan.iteration_time, pipeline_time([s0, 2 * s1], 16)
    balanced = rebalanced(plan, {0: s0, 1: 2 * s1, 2: s0, 3: s1})
    fast_again = max(pipeline_time([s0, s1], p.microbatches) for p in balanced.plan.pipelines)  # [10, 22] at 1x
    res = run(book, trace((SLOW_AT, "slow", 1, 2.0), (1800.0, "recover", 1, None)), "rebalance")
    done1, boundary1 = mark_boundary(SLOW_AT / full, slow, SLOW_AT)
    resume1 = boundary1 + COSTS.rebuild_s
    done2, boundary2 = mark_boundary((1800.0 - resume1) / balanced.step_s, fast_again, 1800.0)
    resume2 = boundary2 + COSTS.rebuild_s
    assert [s.iteration_s for s in res.segments] == pytest.approx([full, slow, balanced.step_s, fast_again, full])
    assert [s.start_s for s in res.segments] == pytest.approx([0.0, SLOW_AT, resume1, 1800.0, resume2])
    assert res.steps == done1 + done2 + math.floor((HORIZON - resume2) / full + 1e-9)
    assert res.resplits == 2


def test_auto_swaps_the_slow_node_for_a_spare_and_gets_back_to_full_speed(book: PlanBook, plan: Plan) -> None:
    s0, s1 = stage_times(book)
    full, slow = plan.iteration_time, pipeline_time([s0, 2 * s1], 16)
    t = trace((SLOW_AT, "slow", 1, 2.0))
    res = run(book, t, "auto", spares=1)
    (stage,) = [st for pipe in plan.pipelines for st in pipe.stages if st.node == 1]
    fetch = sum(book.profile.layer_bytes(i) for i in range(*stage.layers))  # the spare fetches node 1's stage
    done, boundary = mark_boundary(SLOW_AT / full, slow, SLOW_AT)
    resume = boundary + COSTS.replan_s + fetch / CLUSTER.network_bytes_per_s + COSTS.rebuild_s
    assert [s.iteration_s for s in res.segments] == pytest.approx([full, slow, full])
    assert res.segments[-1].start_s == pytest.approx(resume)
    assert res.steps == done + math.floor((HORIZON - resume) / full + 1e-9)
    assert res.slow_swaps == 1 and res.reconfigurations == 1 and res.resplits == 0
    assert res.samples > run(book, t, "rebalance", spares=1).samples
    # Without a spare, auto is rebalance.
    auto, rebalance = run(book, t, "auto").to_dict(), run(book, t, "rebalance").to_dict()
    assert {**auto, "assumptions": None} == {**rebalance, "assumptions": None}


def test_a_swapped_out_slow_node_is_the_last_spare_taken(book: PlanBook, plan: Plan) -> None:
    s0, s1 = stage_times(book)
    t = trace((SLOW_AT, "slow", 1, 2.0), (1800.0, "fail", 0, None))
    # Two spares (4, 5): 4 replaces slow node 1, then the failure of node 0 takes 5, not 1.
    two = run(book, t, "auto", spares=2)
    assert two.segments[-1].iteration_s == plan.iteration_time and two.spares_taken == 1
    # One spare: after the swap only slow node 1 is left; the failure takes it back in, at stage 0
    # of pipeline 0 (nodes 1 and 4), where it is slow again.
    one = run(book, t, "auto", spares=1)
    after = substitute(substitute(plan, {1: 4}), {0: 1})
    assert after.pipelines[0].nodes == (1, 4)
    after_failure = [s for s in one.segments if s.start_s > 1800.0]
    assert after_failure[0].iteration_s == pytest.approx(pipeline_time([2 * s0, s1], 16))
    assert one.resplits == 1 and one.slow_swaps == 1  # no free spare left: rebalance instead


def test_a_failure_carries_the_survivors_slowness_into_the_new_plan(book8: PlanBook) -> None:
    """8 nodes (4 pipelines of 2); node 7 fails and its mate 6 moves into node 1's pipeline."""
    plan = book8.initial_plan()
    res = run_policy("elastic", book8, COSTS, trace8((SLOW_AT, "slow", 1, 2.0), (1200.0, "fail", 7, None)),
                     HORIZON, stragglers="off")
    new = replan(book8.elastic, plan, list(range(7)), global_microbatches=32, fault_tolerance=1).plan
    (pipe,) = [p for p in new.pipelines if 1 in p.nodes]
    assert len(pipe.stages) == 3
    times = list(book8.elastic.template(3).stage_times)
    times[pipe.nodes.index(1)] *= 2
    slowest = max(pipeline_time(times if p is pipe else book8.elastic.template(len(p.stages)).stage_times,
                                p.microbatches, p.virtual_stages) for p in new.pipelines)
    assert res.segments[-1].iteration_s == pytest.approx(slowest) and slowest > new.iteration_time


def test_a_failing_slow_node_comes_back_at_full_speed(book8: PlanBook) -> None:
    plan = book8.initial_plan()
    t = trace8((SLOW_AT, "slow", 1, 2.0), (1200.0, "fail", 1, None), (1800.0, "join", 1, None))
    res = run_policy("elastic", book8, COSTS, t, HORIZON, stragglers="rebalance")
    shrunk = replan(book8.elastic, plan, [0, *range(2, 8)], global_microbatches=32, fault_tolerance=1).plan
    grown = replan(book8.elastic, shrunk, list(range(8)), global_microbatches=32, fault_tolerance=1).plan
    assert res.segments[-1].iteration_s == grown.iteration_time
    assert res.resplits == 1  # for the slowdown; nothing after the failure


def test_the_baselines_do_nothing_and_run_at_the_slow_pace(book: PlanBook) -> None:
    policy = RedundantPolicy(book, COSTS)
    assert book.redundant is not None
    plain = policy.run(trace(), HORIZON)
    base = book.shape_plan("redundant", [0, 1, 2, 3])
    assert base is not None
    node = base.pipelines[0].nodes[0]
    res = policy.run(trace((SLOW_AT, "slow", node, 2.0)), HORIZON)
    times = list(book.redundant.template(len(base.pipelines[0].stages)).stage_times)
    times[0] *= 2
    slow = max(pipeline_time(times, base.pipelines[0].microbatches), base.iteration_time)
    assert res.segments[-1].iteration_s == pytest.approx(slow)
    assert res.steps == math.floor(SLOW_AT / base.iteration_time + (HORIZON - SLOW_AT) / slow + 1e-9) < plain.steps


def checkpoint_reference(pace: list[tuple[float, float]], *, every: int, write_s: float,
                         until: float) -> tuple[int, int, float, float]:
    """(steps run, steps saved, writing seconds, training seconds since the last checkpoint) at
    `until`, stepping one step and one write at a time through `pace` [(from time, seconds a step)]."""
    def step_s_at(t: float) -> float:
        return [s for start, s in pace if start <= t][-1]

    t, run_steps, saved, writing, since = 0.0, 0, 0, 0.0, 0.0
    while True:
        for _ in range(every):
            left, start = 1.0, t
            while left > 1e-12:  # one step, across changes of pace
                nxt = min([start_ for start_, _ in pace if start_ > t] + [math.inf])
                dt = left * step_s_at(t)
                if t + dt <= nxt:
                    t, left = t + dt, 0.0
                else:
                    left -= (nxt - t) / step_s_at(t)
                    t = nxt
                if t >= until:
                    return run_steps, saved, writing, since + (until - start)
            since += t - start
            run_steps += 1
        if t + write_s >= until:
            return run_steps, saved, writing + until - t, since
        t += write_s
        writing += write_s
        saved, since = run_steps, 0.0


def test_checkpoint_restart_keeps_its_k_and_slows_down(book: PlanBook) -> None:
    costs = RecoveryCosts(replan_s=0.05, checkpoint_interval_s=120.0, partial_replay=False, transfer_gbps=None)
    policy = CheckpointRestartPolicy(book, costs)
    base = book.shape_plan("flat", [0, 1, 2, 3])
    assert base is not None
    node = base.pipelines[0].nodes[0]
    times = list(book.flat.template(len(base.pipelines[0].stages)).stage_times)
    times[0] *= 3
    slow = max(pipeline_time(times, base.pipelines[0].microbatches), base.iteration_time)
    every = max(1, round(120.0 / base.iteration_time))
    pace = [(0.0, base.iteration_time), (SLOW_AT, slow), (1500.0, base.iteration_time)]
    t = trace((SLOW_AT, "slow", node, 3.0), (1500.0, "recover", node, None))
    res = policy.run(t, HORIZON)
    run_steps, _, writing, _ = checkpoint_reference(pace, every=every, write_s=policy.write_s, until=HORIZON)
    assert res.steps == run_steps and res.checkpoint_s == pytest.approx(writing)
    # A failure while slow loses exactly the training since the last completed checkpoint.
    fail_at = 1300.0
    cut = policy.run(trace((SLOW_AT, "slow", node, 3.0), (fail_at, "fail", node, None)), fail_at + 1.0)
    _, saved, writing, since = checkpoint_reference(pace[:2], every=every, write_s=policy.write_s, until=fail_at)
    assert cut.steps == saved and cut.lost_s == pytest.approx(since) and cut.checkpoint_s == pytest.approx(writing)


def test_the_report_puts_the_straggler_policy_beside_doing_nothing() -> None:
    t = trace((SLOW_AT, "slow", 1, 2.0), (1800.0, "recover", 1, None))
    report = simulate(CLUSTER, COSTS, t, horizon_s=HORIZON, spares=1, stragglers="auto")
    rows = {p["policy"]: p for p in report["policies"]}
    assert list(rows) == ["elastic", STRAGGLERS_OFF, "checkpoint-restart", "redundant", "recycle"]
    assert rows["elastic"]["effective"] > rows[STRAGGLERS_OFF]["effective"]
    assert rows["elastic"]["slow_swaps"] == 1
    assert report["stragglers"]["policy"] == "auto" and report["trace"]["slowdowns"] == 1
    assert any("auto" in a for a in rows["elastic"]["assumptions"])
    assert any("stragglers off" in a for a in rows[STRAGGLERS_OFF]["assumptions"])
    for p in report["policies"]:
        assert p["training_s"] + p["recovery_s"] + p["checkpoint_s"] == pytest.approx(HORIZON)
        assert any("slow" in a for a in p["assumptions"])
    # Stragglers off: no extra row; no slow events: nothing about stragglers at all.
    assert len(simulate(CLUSTER, COSTS, t, horizon_s=HORIZON, stragglers="off")["policies"]) == 4
    plain = simulate(CLUSTER, COSTS, trace(), horizon_s=HORIZON)
    assert "stragglers" not in plain and "slowdowns" not in plain["trace"] and len(plain["policies"]) == 4
    with pytest.raises(ValueError, match="straggler-policy"):
        simulate(CLUSTER, COSTS, t, horizon_s=HORIZON, stragglers="pray")


def test_cli_prints_the_rows_and_the_assumptions(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--model", "gpt3-350m", "--nodes", "4", "--device-memory-gib", "16", "--global-batch", "32",
            "--hours", "1", "--trace", "slow_every=10m,slow_for=5m", "--replan-s", "0.05"]
    assert main([*argv, "--json", "--straggler-policy", "auto", "--spares", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [p["policy"] for p in report["policies"]][:2] == ["elastic", STRAGGLERS_OFF]
    assert report["trace"]["slowdowns"] == 6 and report["costs"]["straggler_detect_steps"] == DETECT
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "elastic (stragglers off)" in table and "stragglers rebalance: a node is marked 12 steps" in table
