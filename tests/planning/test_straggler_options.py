"""`--straggler-policy auto`'s options (elastic/planning/straggler_options.py) against estimates
written out here: the 1F1B step of each split, the best split by exhaustive search, a spare as
fast as the straggler's peers, and a drop re-planned as a drain is."""

from __future__ import annotations

import dataclasses

import pytest

from elastic.planning.cluster import ClusterSpec, cluster_templates
from elastic.planning.straggler_options import Options, choose, straggler_options
from elastic.planning.stragglers import measured_stage_times
from templates.instantiation import instantiate
from templates.plan import Plan
from templates.replanning import replan
from templates.template_set import PlanningError, TemplateSet


def _setup(nodes: int) -> tuple[TemplateSet, Plan]:
    spec = ClusterSpec(model="tiny", nodes=nodes, fault_tolerance=1, global_batch=32, microbatch=2,
                       device_memory_gib=0.03)
    tset = cluster_templates(dataclasses.replace(spec, fault_tolerance=0))  # as the leader builds it
    return tset, instantiate(tset, list(range(nodes)), global_microbatches=16, fault_tolerance=1)


def _step(plan: Plan, per_mb: dict[int, float], counts: tuple[int, ...] | None = None) -> float:
    """The slowest pipeline's 1F1B time, written out: fill and drain, then m - 1 rounds of the slowest."""
    counts = counts or tuple(p.microbatches for p in plan.pipelines)
    return max(sum(per_mb[s.node] for s in p.stages) + (m - 1) * max(per_mb[s.node] for s in p.stages)
               for p, m in zip(plan.pipelines, counts, strict=True))


def _by_kind(options: Options) -> dict[str, float]:
    return {o.kind: o.step_s for o in options.options}


def test_the_must_show_job_takes_the_spare_and_gets_the_failure_free_estimate() -> None:
    tset, plan = _setup(4)
    assert [p.nodes for p in plan.pipelines] == [(0, 1), (2, 3)] and [p.microbatches for p in plan.pipelines] == [8, 8]
    busy = {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.2}  # node 3 at half speed, 8 microbatches a pipeline
    per_mb = {n: b / 8 for n, b in busy.items()}
    options = straggler_options(tset, plan, measured_stage_times(plan, busy), node=3, factor=2.0, spare=4)
    est = _by_kind(options)
    assert options.unchanged_s == pytest.approx(_step(plan, per_mb))
    assert est["rebalance"] == pytest.approx(min(_step(plan, per_mb, (m, 16 - m)) for m in range(1, 16)))
    healthy = {**per_mb, 4: per_mb[3] / 2.0}
    spare = next(o for o in options.options if o.kind == "spare")
    assert [p.nodes for p in spare.plan.pipelines] == [(0, 1), (2, 4)] and [p.microbatches for p in spare.plan.pipelines] == [8, 8]
    assert est["spare"] == pytest.approx(_step(spare.plan, healthy)) == pytest.approx(_step(plan, {**per_mb, 3: per_mb[0]}))
    with pytest.raises(PlanningError):  # 3 nodes cannot form this job's 2 pipelines: no drop
        replan(tset, plan, [0, 1, 2], global_microbatches=16, fault_tolerance=1)
    assert "drop" not in est
    chosen = choose(options, gain=0.1)
    assert chosen is not None and chosen.kind == "spare" and chosen.spare == 4 and chosen.node == 3
    assert options.summary().startswith("nothing ") and "spare " in options.summary()


def test_without_a_spare_the_must_show_job_rebalances() -> None:
    tset, plan = _setup(4)
    busy = {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.2}
    chosen = choose(straggler_options(tset, plan, measured_stage_times(plan, busy), node=3, factor=2.0, spare=None),
                    gain=0.1)
    assert chosen is not None and chosen.kind == "rebalance"
    assert [p.microbatches for p in chosen.plan.pipelines] == [11, 5]


def test_noise_changes_nothing() -> None:
    tset, plan = _setup(4)
    busy = {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.105}
    options = straggler_options(tset, plan, measured_stage_times(plan, busy), node=3, factor=1.05, spare=4)
    assert choose(options, gain=0.1) is None  # no option is 10 % faster than doing nothing


@pytest.mark.parametrize("factor", [15.0, 30.0])
def test_a_very_slow_node_is_dropped_when_the_others_do_better_without_it(factor: float) -> None:
    tset, plan = _setup(6)
    assert [p.nodes for p in plan.pipelines] == [(0, 1), (2, 3), (4, 5)]
    busy = {n: 0.1 * p.microbatches / 6 for p in plan.pipelines for n in p.nodes}
    busy[5] *= factor
    per_mb = {s.node: busy[s.node] / p.microbatches for p in plan.pipelines for s in p.stages}
    options = straggler_options(tset, plan, measured_stage_times(plan, busy), node=5, factor=factor, spare=None)
    drop = next(o for o in options.options if o.kind == "drop")
    expected = replan(tset, plan, [0, 1, 2, 3, 4], global_microbatches=16, fault_tolerance=1).plan
    assert drop.plan == expected  # what a drain of node 5 publishes
    layers = {s.node: s.layers[1] - s.layers[0] for p in plan.pipelines for s in p.stages}
    moved = {s.node: per_mb[s.node] / layers[s.node] * (s.layers[1] - s.layers[0])
             for p in expected.pipelines for s in p.stages}
    assert drop.step_s == pytest.approx(_step(expected, moved))
    chosen = choose(options, gain=0.1)
    assert chosen is not None and chosen.kind == "drop"
    assert drop.step_s < _by_kind(options)["rebalance"]


def test_every_plan_node_needs_a_measure() -> None:
    tset, plan = _setup(4)
    with pytest.raises(ValueError, match=r"no measured stage time for nodes \[2\]"):
        straggler_options(tset, plan, {0: 0.1, 1: 0.1, 3: 0.2}, node=3, factor=2.0, spare=None)
