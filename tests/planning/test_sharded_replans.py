"""The leader's re-plans of a sharded run count the optimizer slices they will have (issue 55).

A run planned with its holders keeping 1/S of the AdamW moments records S
(`ClusterSpec.moment_slices`); the leader's templates (`replan_templates`) count 1/S, need the
S (f + 1) pipelines that make it so, and fall back to templates counting whole moments where the
live nodes cannot form them. Checked against the memory model (`plan_memory`, which the tensor
walk of a real Trainer equals: tests/engine/test_memory_model.py) with the S each plan really has,
and against the plans the whole-moment templates (the leader's before) make.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from elastic.planning.cluster import ClusterSpec, cluster_templates, replan_templates
from elastic.planning.footprint import MOMENT_BYTES, sharded_moment_elements
from elastic.planning.memory import plan_memory
from elastic.planning.optimizer_choice import choose_plan, plan_slices
from elastic.roles.leader_replan import Fallback, fallback_plan, replan_after
from templates.cost import moment_bytes
from templates.instantiation import instantiate
from templates.optim_slices import plan_owners
from templates.plan import Plan
from templates.template_set import PlanningError, TemplateSet

pytestmark = pytest.mark.timeout(120)

# tiny at 0.032 GiB: a one-stage pipeline fits only with half its moments, two stages fit whole
FOUR = ClusterSpec(model="tiny", nodes=4, fault_tolerance=1, global_batch=8, microbatch=1, device_memory_gib=0.032)
# 8 nodes at 0.040 GiB: one stage fits with half its moments or less; the planner counts a third
EIGHT = dataclasses.replace(FOUR, nodes=8, global_batch=16, device_memory_gib=0.040)
# at 0.015 GiB with microbatches of 2, no plan of 7 nodes fits with whole moments
ONLY_SHARDED = ClusterSpec(model="tiny", nodes=7, fault_tolerance=0, global_batch=8, microbatch=2,
                           device_memory_gib=0.015)


def _fits(spec: ClusterSpec, plan: Plan) -> bool:
    """Whether `plan`'s largest worker, sharded with the slices the plan has, fits the device by the
    memory model (whose gradient figures the planner bounds for even batch splits only)."""
    peak = plan_memory(spec.config, plan, device_type=spec.device_type, sharded_optimizer=True)
    return peak.estimate.total <= spec.device_memory_gib * 2**30


def _moments_counted(spec: ClusterSpec, tset: TemplateSet, plan: Plan) -> bool:
    """Whether every worker of `plan` keeps at most the moment bytes that the templates it came
    from (`tset.serving(plan)`) counted for its layers, with the slices the plan really has."""
    counted = tset.serving(plan)
    for pipe in plan.pipelines:
        for st in pipe.stages:
            held = [i for a, b in st.ranges for i in range(a, b)]
            kept = sharded_moment_elements(spec.config, plan, node=st.node, layers=held) * MOMENT_BYTES
            planned = sum(moment_bytes(counted.profile.layers[i].optimizer_bytes, counted.moment_slices) for i in held)
            if kept > planned:
                return False
    return True


def _leader(spec: ClusterSpec) -> tuple[Plan, TemplateSet]:
    chosen = choose_plan(spec, "on")
    assert chosen.sharded and chosen.counted_slices > 1
    return chosen.plan, replan_templates(dataclasses.replace(spec, moment_slices=chosen.counted_slices))


def _replan(tset: TemplateSet, plan: Plan, lost: tuple[int, ...]) -> tuple[Plan, str]:
    """The leader's plan after `lost` (a checkpoint fallback's where a slice lost every owner)."""
    live = [n for n in plan.nodes if n not in lost]
    got = replan_after(tset, plan, live, {}, lost=list(lost), joined=[], owners=plan_owners(plan))
    if isinstance(got, Fallback):
        return fallback_plan(tset, plan, got, checkpoint=4, steps=10, skipped=[])
    return got


def test_a_plan_counting_slices_has_the_pipelines_that_make_it_true() -> None:
    for spec in (FOUR, EIGHT):
        for slices in (2, 3):
            tset = cluster_templates(spec, moment_slices=slices)
            for f, n in itertools.product((0, 1), range(1, spec.nodes + 1)):
                try:
                    plan = instantiate(tset, list(range(n)), global_microbatches=spec.global_microbatches,
                                       fault_tolerance=f)
                except PlanningError as exc:
                    assert n < tset.pipelines_needed(f) * tset.min_nodes or "microbatches" in str(exc), exc
                    continue
                assert len(plan.pipelines) >= slices * (f + 1) and plan_slices(plan) >= slices
                assert _moments_counted(spec, tset, plan), (slices, f, n)
    with pytest.raises(PlanningError, match=r"3 nodes cannot form 4 pipelines for fault tolerance 1 with each "
                                            r"holder keeping 1/2 of its moments"):
        instantiate(cluster_templates(FOUR, moment_slices=2), [0, 1, 2], global_microbatches=8, fault_tolerance=1)


def test_a_loss_keeps_the_layout_the_slices_bought() -> None:
    """4 one-stage pipelines (S = 2). Node 3 lost: no 4 pipelines for f = 1, nor 2 of two stages with
    whole moments; the leader relaxes f and keeps 3 one-stage pipelines (S = 3), where templates
    counting whole moments made one pipeline of 3 stages, less than half as fast by the cost model."""
    plan, tset = _leader(FOUR)
    assert [len(p.stages) for p in plan.pipelines] == [1, 1, 1, 1]
    new, why = _replan(tset, plan, (3,))
    assert [len(p.stages) for p in new.pipelines] == [1, 1, 1] and new.fault_tolerance == 0, new
    assert _fits(FOUR, new) and "relaxed from 1 to 0" in why and "whole moments" not in why
    whole, _ = _replan(cluster_templates(dataclasses.replace(FOUR, fault_tolerance=0)), plan, (3,))
    assert [len(p.stages) for p in whole.pipelines] == [3]
    assert new.iteration_time < whole.iteration_time / 2


def test_every_replan_fits_with_the_slices_it_has_and_keeps_f_where_the_nodes_allow() -> None:
    """8 one-stage pipelines, S = 3 counted. Every loss of 1 to 4 nodes: every worker keeps at most
    the moments its plan's templates counted, at the plan's own S; with 6 or more survivors it keeps f = 1 and 1/3 of the moments; with 4 or 5
    it keeps f = 1 on whole moments (and says so); a slice that lost both owners falls back."""
    plan, tset = _leader(EIGHT)
    assert len(plan.pipelines) == 8 and tset.moment_slices == 3 and tset.fallback is not None
    for k in range(1, 5):
        for lost in itertools.combinations(range(8), k):
            new, why = _replan(tset, plan, lost)
            assert _moments_counted(EIGHT, tset, new), (lost, new)
            if "CHECKPOINT FALLBACK" not in why:
                assert new.fault_tolerance == 1, (lost, why)
            if 8 - k >= 6:
                assert len(new.pipelines) >= 6 and plan_slices(new) >= 3 and "whole moments" not in why, (lost, why)
            else:
                assert len(new.pipelines) < 6 and "planned with whole moments" in why, (lost, why)


def test_a_model_that_fits_only_sharded_is_planned_sharded_and_replanned_sharded() -> None:
    with pytest.raises(PlanningError, match=r"it fits with the optimizer's moments sharded \(--shard-optimizer on"):
        choose_plan(ONLY_SHARDED, "off")
    for mode in ("auto", "on"):  # auto shards at f = 0 here: nothing else fits
        chosen = choose_plan(ONLY_SHARDED, mode)
        assert chosen.sharded and chosen.unsharded_time is None
        assert _moments_counted(ONLY_SHARDED, chosen.tset, chosen.plan)
    plan, tset = _leader(ONLY_SHARDED)
    for lost in itertools.combinations(plan.nodes, 1):
        new, why = _replan(tset, plan, lost)
        assert _moments_counted(ONLY_SHARDED, tset, new), (lost, new)
        assert "CHECKPOINT FALLBACK" in why  # at f = 0 every slice had one owner
