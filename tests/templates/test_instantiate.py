"""Instantiation: every plan is valid, optimal over template multisets, and exists when it should."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from templates.cost import StageCosts
from templates.instantiation import instantiate, split_microbatches
from templates.interleave import in_flight
from templates.plan import Plan
from templates.profile import Profile
from templates.template_set import PlanningError, TemplateSet, build_templates
from tests.templates.helpers import SLOW_OR_FILTERED, profiles


def check_plan(plan: Plan, tset: TemplateSet, nodes: list[int], microbatches: int, f: int) -> None:
    """Every invariant a plan must satisfy, checked directly (not through Plan's own validation)."""
    placed = [stage.node for pipe in plan.pipelines for stage in pipe.stages]
    assert sorted(placed) == sorted(nodes), "every node exactly once"
    assert len(plan.pipelines) >= f + 1
    assert sum(p.microbatches for p in plan.pipelines) == microbatches
    costs = StageCosts(tset.profile, tset.gpus_per_node)
    for pipe in plan.pipelines:
        assert pipe.microbatches >= 1
        covered = [layer for first, last in pipe.virtual_ranges for layer in range(first, last)]
        assert covered == list(range(tset.num_layers)), "each layer once, in order"
        depth = len(pipe.stages)
        for s, stage in enumerate(pipe.stages):
            if pipe.virtual_stages == 1:
                assert costs.stage_fits(stage.first, stage.last, depth - s), "stage exceeds memory"
            else:  # each chunk's in-flight activations as the interleaved schedule holds them
                held = in_flight(depth, s, pipe.virtual_stages)
                assert costs.chunks_memory(stage.ranges, stage.recompute, held, s == depth - 1) <= costs.capacity
    assert plan.iteration_time == pytest.approx(max(p.iteration_time for p in plan.pipelines))


def best_over_multisets(tset: TemplateSet, num_nodes: int, microbatches: int, f: int) -> float | None:
    """Brute force: every multiset of template sizes covering exactly num_nodes."""
    sizes = tset.sizes
    best: list[float] = []

    def walk(left: int, start: int, chosen: list[int]) -> None:
        if left == 0:
            if f + 1 <= len(chosen) <= microbatches:
                temps = [tset.templates[n] for n in chosen]
                counts = split_microbatches(temps, microbatches)
                best.append(max(t.time_for(c) for t, c in zip(temps, counts, strict=True)))
            return
        for i in range(start, len(sizes)):
            if sizes[i] <= left:
                walk(left - sizes[i], i, [*chosen, sizes[i]])

    walk(num_nodes, 0, [])
    return min(best) if best else None


@pytest.mark.timeout(120)
@settings(max_examples=60, deadline=None, suppress_health_check=SLOW_OR_FILTERED)
@given(
    profile=profiles(min_layers=8, max_layers=12),
    gpus=st.sampled_from([1, 2]),
    total=st.integers(1, 8),
    f=st.integers(0, 2),
    extra=st.integers(0, 12),
    virtual=st.sampled_from([1, 0, 2]),
)
def test_plans_valid_optimal_and_exist_for_every_cluster_size(
    profile: Profile, gpus: int, total: int, f: int, extra: int, virtual: int
) -> None:
    """`virtual`: templates of 2+ nodes interleaved (0: each at its fastest v, 2: forced where it
    fits); the search over template multisets must stay exact under their step times too."""
    microbatches = total + extra  # enough for any pipeline count
    try:
        tset = build_templates(
            profile, gpus_per_node=gpus, num_nodes=total, fault_tolerance=f, global_microbatches=microbatches,
            virtual_stages=virtual,
        )
    except PlanningError:
        assume(False)
        return
    # Oobleck's premise: a template for every size in [n0, n_max]. Then N in [(f+1) n0, N_total]
    # always has a plan (f pipelines of n0 and one of N - f n0).
    assume(tset.sizes == list(range(tset.min_nodes, tset.max_nodes + 1)))
    for n in range((f + 1) * tset.min_nodes, total + 1):
        nodes = [10 + 3 * i for i in range(n)]  # arbitrary ids
        plan = instantiate(tset, nodes, global_microbatches=microbatches, fault_tolerance=f)
        check_plan(plan, tset, nodes, microbatches, f)
        reference = best_over_multisets(tset, n, microbatches, f)
        assert reference is not None
        assert plan.iteration_time == pytest.approx(reference, rel=1e-9)
    if (f + 1) * tset.min_nodes > 1:
        with pytest.raises(PlanningError, match="missing"):
            instantiate(
                tset,
                list(range((f + 1) * tset.min_nodes - 1)),
                global_microbatches=microbatches,
                fault_tolerance=f,
            )


@pytest.mark.timeout(60)
@settings(max_examples=60, deadline=None, suppress_health_check=SLOW_OR_FILTERED)
@given(
    bottlenecks=st.lists(st.floats(0.1, 5.0), min_size=1, max_size=4),
    rests=st.lists(st.floats(0.0, 5.0), min_size=4, max_size=4),
    total=st.integers(4, 30),
)
def test_split_microbatches_is_optimal(bottlenecks: list[float], rests: list[float], total: int) -> None:
    from itertools import product

    from templates.search import PipelineTemplate

    temps = [
        PipelineTemplate(num_nodes=2, stages=((0, 1), (1, 2)), stage_times=(b, r + b), microbatches=1)
        for b, r in zip(bottlenecks, rests, strict=False)
    ]
    assume(total >= len(temps))
    counts = split_microbatches(temps, total)
    assert sum(counts) == total and min(counts) >= 1
    got = max(t.time_for(c) for t, c in zip(temps, counts, strict=True))
    best = min(
        max(t.time_for(c) for t, c in zip(temps, combo, strict=True))
        for combo in product(range(1, total + 1), repeat=len(temps))
        if sum(combo) == total
    )
    assert got == pytest.approx(best, rel=1e-12)


@pytest.mark.timeout(60)
def test_too_few_nodes_says_what_is_missing() -> None:
    from templates.profile import DeviceProfile, LayerProfile

    layer = LayerProfile(
        forward=1.0, backward=2.0, param_bytes=100, optimizer_bytes=200, activation_bytes=0, output_bytes=1
    )
    device = DeviceProfile(
        memory_bytes=1000, p2p_latency=0.0, p2p_bandwidth=1.0, allreduce_latency=0.0, allreduce_bandwidth=1.0
    )
    profile = Profile(model="m", microbatch_size=1, layers=(layer,) * 8, device=device)  # 3200 B: n0 = 4
    tset = build_templates(profile, gpus_per_node=1, num_nodes=12, fault_tolerance=1, global_microbatches=8)
    assert tset.min_nodes == 4 and tset.max_nodes == 8
    plan = instantiate(tset, list(range(12)), global_microbatches=8, fault_tolerance=1)
    assert len(plan.pipelines) >= 2
    with pytest.raises(PlanningError) as err:
        instantiate(tset, list(range(7)), global_microbatches=8, fault_tolerance=1)
    assert "7 nodes cannot form 2 pipelines for fault tolerance 1" in str(err.value)
    assert "8 are needed (1 missing)" in str(err.value)
    with pytest.raises(PlanningError, match="fault tolerance 2 needs 3 pipelines of at least 4 nodes"):
        build_templates(profile, gpus_per_node=1, num_nodes=11, fault_tolerance=2, global_microbatches=8)
