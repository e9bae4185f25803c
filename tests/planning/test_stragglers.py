"""The straggler detector (elastic/planning/stragglers.py) on step-time series: noise, a short
spike, a sustained slowdown and its recovery; its speed factors against a direct computation of
"cost over the median of the peers' costs"."""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.planning.cluster import ClusterSpec, cluster_templates
from elastic.planning.stragglers import (
    Change,
    NodeWork,
    SpeedTracker,
    StragglerConfig,
    measured_stage_times,
    node_work,
    rebalanced,
    speed_factors,
    template_stage_times,
)
from templates.instantiation import instantiate
from templates.plan import PipelinePlan, Plan, StagePlan

TWO_BY_TWO = Plan(num_layers=6, microbatch_size=1, gpus_per_node=1, fault_tolerance=1, pipelines=(
    PipelinePlan(stages=(StagePlan(node=0, layers=(0, 3)), StagePlan(node=1, layers=(3, 6))), microbatches=8),
    PipelinePlan(stages=(StagePlan(node=2, layers=(0, 3)), StagePlan(node=3, layers=(3, 6))), microbatches=8),
))
WORK = node_work(TWO_BY_TWO)
BASE = {0: 0.040, 1: 0.055, 2: 0.040, 3: 0.055}
"""Busy seconds of a step per node: first stages (embedding) and last stages (head) differ."""


def series(steps: int, *, noise: float, slow: dict[int, tuple[int, int, float]] | None = None,
           seed: int = 0) -> list[dict[int, float]]:
    """Busy seconds per step and node, with multiplicative noise (+-`noise`) and slow windows
    node -> (first step, end step, factor)."""
    rng = random.Random(seed)
    out = []
    for step in range(steps):
        busy = {}
        for n, base in BASE.items():
            factor = 1.0
            if slow and n in slow and slow[n][0] <= step < slow[n][1]:
                factor = slow[n][2]
            busy[n] = base * factor * (1.0 + rng.uniform(-noise, noise))
        out.append(busy)
    return out


def run(tracker: SpeedTracker, steps: list[dict[int, float]]) -> list[Change]:
    return [c for step, busy in enumerate(steps) for c in tracker.observe(step, busy, WORK)]


def test_noise_marks_nobody() -> None:
    for seed in range(5):
        assert run(SpeedTracker(StragglerConfig()), series(2000, noise=0.2, seed=seed)) == []


def test_a_short_spike_marks_nobody() -> None:
    # 9 steps at 4x: the 5-step median is slow for 9 steps, and a mark needs 10 in a row (the
    # default window and steps).
    changes = run(SpeedTracker(StragglerConfig()), series(200, noise=0.1, slow={1: (50, 59, 4.0)}))
    assert changes == []


def test_a_sustained_slowdown_is_marked_then_cleared_after_the_release() -> None:
    config = StragglerConfig()
    changes = run(SpeedTracker(config), series(400, noise=0.1, slow={3: (100, 250, 2.0)}))
    assert [(c.node, c.marked) for c in changes] == [(3, True), (3, False)]
    marked, cleared = changes
    # The median moves once most of the window is slow; then `steps` in a row.
    lag = config.window // 2 + config.steps - 1
    assert marked.step == 100 + lag and 1.8 <= marked.factor <= 2.2
    assert cleared.step == 250 + lag and cleared.factor < config.recovered_below


def test_hysteresis_keeps_a_mark_between_the_thresholds() -> None:
    # 2x, then 1.2x (below the 1.25 threshold, above the 1.125 recovery): the mark stays.
    steps = series(100, noise=0.02, slow={0: (20, 100, 2.0)}) + series(
        200, noise=0.02, slow={0: (0, 200, 1.2)}, seed=1)
    changes = run(SpeedTracker(StragglerConfig()), steps)
    assert [(c.node, c.marked) for c in changes] == [(0, True)]


def test_a_node_that_leaves_the_plan_loses_its_mark() -> None:
    tracker = SpeedTracker(StragglerConfig(steps=3, window=1))
    run(tracker, series(10, noise=0.0, slow={2: (0, 10, 3.0)}))
    assert tracker.marked == {2: 2}
    without = {n: w for n, w in WORK.items() if n != 2}
    (change,) = tracker.observe(10, {n: BASE[n] for n in without}, without)
    assert (change.node, change.marked) == (2, False) and tracker.marked == {}


def test_the_work_of_each_node_follows_the_plan() -> None:
    assert {0: NodeWork(work=24.0, position="first"), 1: NodeWork(work=24.0, position="last"),
                    2: NodeWork(work=24.0, position="first"), 3: NodeWork(work=24.0, position="last")} == WORK


def _direct(busy: dict[int, float], work: dict[int, NodeWork]) -> dict[int, float]:
    """The factors as the module doc defines them, one node at a time."""
    cost = {n: busy[n] / work[n].work for n in busy}
    out = {}
    for n in cost:
        peers = [cost[m] for m in cost if m != n and work[m].position == work[n].position]
        peers = peers or [cost[m] for m in cost if m != n]
        out[n] = cost[n] / statistics.median(peers) if peers else 1.0
    return out


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(
    st.integers(0, 40),
    st.tuples(st.floats(0.001, 10.0), st.integers(1, 64), st.sampled_from(["whole", "first", "middle", "last"])),
    min_size=1, max_size=24,
))
def test_speed_factors_are_the_direct_definition(nodes: dict[int, tuple[float, int, str]]) -> None:
    busy = {n: b for n, (b, _, _) in nodes.items()}
    work = {n: NodeWork(work=float(w), position=p) for n, (_, w, p) in nodes.items()}  # type: ignore[arg-type]
    got, want = speed_factors(busy, work), _direct(busy, work)
    assert got.keys() == want.keys()
    for n in want:
        assert got[n] == pytest.approx(want[n], rel=1e-12), n


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"policy": "fast"}, "straggler policy must be one of off, report"),
    ({"threshold": 1.0}, "threshold must be above 1.0"),
    ({"steps": 0}, "steps must be at least 1"),
    ({"window": 0}, "window must be at least 1"),
    ({"clear_below": 1.5}, "clear_below must be in"),
])
def test_bad_settings_are_refused_with_one_line(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StragglerConfig(**kwargs)  # type: ignore[arg-type]


# ---- recorded series: tiny on 4 nodes as 2 two-stage pipelines, global batch 32 (16 microbatches),
# on this 2-core machine, with $ELASTIC_BUSY_TRACE (elastic/roles/straggler_reporter.py) -----------

DATA = Path(__file__).parent / "data"
RECORDED = Plan(num_layers=6, microbatch_size=2, gpus_per_node=1, fault_tolerance=1, pipelines=(
    PipelinePlan(stages=(StagePlan(node=0, layers=(0, 3)), StagePlan(node=1, layers=(3, 6))), microbatches=8),
    PipelinePlan(stages=(StagePlan(node=2, layers=(0, 3)), StagePlan(node=3, layers=(3, 6))), microbatches=8),
))


def replay(name: str) -> list[Change]:
    """The default detector over a recorded run, its first 2 steps left out as the reporter does."""
    tracker, work = SpeedTracker(StragglerConfig()), node_work(RECORDED)
    changes = []
    for line in (DATA / name).read_text().splitlines()[2:]:
        row = json.loads(line)
        changes += tracker.observe(row["step"], {int(n): b for n, b in row["busy"].items()}, work)
    return changes


def test_a_recorded_failure_free_run_marks_nobody() -> None:
    """400 steps, `elastic run --nodes 4 --fault-tolerance 1 --device-memory-gib 0.03 --global-batch 32`."""
    assert replay("busy-failure-free-tiny-2x2.jsonl") == []


def test_a_recorded_slow_node_is_marked_in_its_window_and_cleared_after() -> None:
    """300 steps of the same job; `elastic inject slow --node 3 --factor 2 --seconds 12 --at-step 50`
    slowed node 3 from step 50 to step 92 (the injection's status)."""
    changes = replay("busy-slow-node3-x2-from-step50-tiny-2x2.jsonl")
    assert [(c.node, c.marked) for c in changes] == [(3, True), (3, False)]
    marked, cleared = changes
    assert 50 < marked.step <= 50 + 15 and marked.factor >= 1.5
    assert 92 < cleared.step <= 92 + 20 and cleared.factor < 1.125


# ---- acting: rebalance ---------------------------------------------------------------------

SPEC = ClusterSpec(model="tiny", nodes=4, fault_tolerance=1, global_batch=32, microbatch=2, device_memory_gib=0.03)
TSET = cluster_templates(dataclasses.replace(SPEC, fault_tolerance=0))  # as the leader builds it
PLAN = instantiate(TSET, [0, 1, 2, 3], global_microbatches=16, fault_tolerance=1)


def _slowest(plan: Plan, times: dict[int, float], counts: tuple[int, ...]) -> float:
    """The step estimate of `counts` microbatches a pipeline (the 1F1B cost, written out)."""
    out = 0.0
    for pipe, m in zip(plan.pipelines, counts, strict=True):
        t = [times[s.node] for s in pipe.stages]
        out = max(out, sum(t) + (m - 1) * max(t))
    return out


def test_the_must_show_job_rebalances_away_from_its_half_speed_node() -> None:
    assert [p.nodes for p in PLAN.pipelines] == [(0, 1), (2, 3)] and [p.microbatches for p in PLAN.pipelines] == [8, 8]
    assert rebalanced(PLAN, template_stage_times(TSET, PLAN)).plan == PLAN  # the planner's own split
    # Measured: every stage 0.1 s a step (8 microbatches), node 3 at half speed.
    measured = measured_stage_times(PLAN, {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.2})
    slow = rebalanced(PLAN, measured)
    assert [p.microbatches for p in slow.plan.pipelines] == [11, 5]
    assert [[(s.node, s.layers) for s in p.stages] for p in slow.plan.pipelines] == \
        [[(s.node, s.layers) for s in p.stages] for p in PLAN.pipelines]  # only the counts move
    # The ceiling here is 0.75x the failure-free rate (pipeline speeds 1 and 0.5); doing nothing 0.5x.
    free = rebalanced(PLAN, measured_stage_times(PLAN, {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1})).step_s
    assert free / slow.step_s == pytest.approx(0.75) and free / slow.unchanged_s == pytest.approx(9 / 17)


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 40), st.lists(st.floats(0.01, 5.0), min_size=4, max_size=4))
def test_the_split_is_the_best_of_every_split(total: int, seconds: list[float]) -> None:
    plan = dataclasses.replace(PLAN, pipelines=tuple(dataclasses.replace(p, microbatches=m) for p, m in
                                                     zip(PLAN.pipelines, (total - total // 2, total // 2), strict=True)))
    times = dict(enumerate(seconds))
    got = rebalanced(plan, times)
    counts = tuple(p.microbatches for p in got.plan.pipelines)
    assert sum(counts) == total and min(counts) >= 1
    best = min(_slowest(plan, times, (m, total - m)) for m in range(1, total))
    assert got.step_s == pytest.approx(best, rel=1e-12) == pytest.approx(_slowest(plan, times, counts), rel=1e-12)
    assert got.unchanged_s == pytest.approx(_slowest(plan, times, (total - total // 2, total // 2)), rel=1e-12)


def test_an_operator_change_keeps_the_settings_it_does_not_name_and_is_checked() -> None:
    from elastic.records.stragglers import PolicyOverride

    base = StragglerConfig(policy="report", threshold=1.5, steps=7)
    assert PolicyOverride(policy="auto", at=0.0).apply(base) == StragglerConfig(policy="auto", threshold=1.5, steps=7)
    assert PolicyOverride(steps=3, at=0.0).apply(base) == dataclasses.replace(base, steps=3)
    with pytest.raises(ValueError, match="straggler policy must be one of off, report, rebalance, auto"):
        PolicyOverride(policy="sometimes", at=0.0).apply(base)
    with pytest.raises(ValueError, match="threshold must be above 1.0"):
        PolicyOverride(threshold=0.9, at=0.0).apply(base)
