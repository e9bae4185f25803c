"""Interleaved templates (issue 53): the min-max cut is exact, each template's v is its fastest
that fits, a forced v applies where it fits, and the cost is `pipeline_time` over the chunks."""

from __future__ import annotations

import itertools
import random

import pytest

from elastic.planning.cluster import ClusterSpec, cluster_templates, initial_plan
from templates.cost import StageCosts, pipeline_time
from templates.interleave import balanced_cut, best_interleaving, in_flight, interleave_template

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("seed", range(20))
def test_the_cut_is_the_least_bottleneck_of_all_cuts(seed: int) -> None:
    rng = random.Random(seed)
    times = [rng.choice([0.1, 1.0, 2.0, 3.5]) * rng.random() + 0.01 for _ in range(rng.randint(2, 9))]
    parts = rng.randint(1, len(times))
    cut = balanced_cut(times, parts)
    assert [a for a, _ in cut] == [0, *[b for _, b in cut[:-1]]] and cut[-1][1] == len(times)
    assert all(a < b for a, b in cut)
    best = min(max(sum(times[a:b]) for a, b in zip((0, *c), (*c, len(times)), strict=False))
               for c in itertools.combinations(range(1, len(times)), parts - 1))
    assert max(sum(times[a:b]) for a, b in cut) == pytest.approx(best)


def test_in_flight_counts_the_warm_up_in_schedule_order() -> None:
    # p = 4, v = 2: stage 0 warms up with 6 + 4 forwards and holds one more (11); the table
    # deals 4 of chunk 0, 4 of chunk 1, then the next group's chunk 0.
    assert in_flight(4, 0, 2) == [7, 4]
    assert in_flight(4, 3, 2) == [4, 1]
    assert sum(in_flight(4, 0, 3)) == (3 - 1) * 4 + 2 * 3 + 1


def _spec(virtual: int) -> ClusterSpec:
    return ClusterSpec(model="gpt3-6.7b", nodes=64, gpus_per_node=8, fault_tolerance=1, global_batch=512,
                       microbatch=2, device_type="cuda", virtual_stages=virtual)


def test_auto_takes_each_templates_fastest_v_and_the_plan_gains() -> None:
    plain, auto = cluster_templates(_spec(1)), cluster_templates(_spec(0))
    assert all(t.virtual_stages == 1 for t in plain.templates.values())
    chosen = {n: t.virtual_stages for n, t in auto.templates.items()}
    assert any(v > 1 for v in chosen.values()), chosen
    costs = StageCosts(auto.profile, 8, "auto")
    for n, t in auto.templates.items():
        base = plain.templates[n]
        assert t.time_for(t.microbatches) <= base.time_for(base.microbatches) * (1 + 1e-9)
        assert t.plain_time_for(t.microbatches) == pytest.approx(base.time_for(base.microbatches))
        for v in range(1, 5):  # no v that fits is faster than the one chosen
            other = interleave_template(base, costs, v)
            if other is not None:
                assert t.time_for(t.microbatches) <= other.time_for(t.microbatches) * (1 + 1e-9)
        if t.virtual_stages > 1:
            assert t.time_for(t.microbatches) == pytest.approx(
                pipeline_time(t.stage_times, t.microbatches, t.virtual_stages))
    assert initial_plan(_spec(0), auto).iteration_time < initial_plan(_spec(1), plain).iteration_time


def test_a_forced_v_applies_where_memory_and_layers_allow() -> None:
    forced = cluster_templates(_spec(3))
    costs = StageCosts(forced.profile, 8, "auto")
    plain = cluster_templates(_spec(1))
    applied = set()
    for n, t in forced.templates.items():
        fits = n >= 2 and n * 3 <= forced.num_layers and interleave_template(plain.templates[n], costs, 3) is not None
        assert t.virtual_stages == (3 if fits else 1), n
        applied.add(fits)
    assert applied == {True, False}  # 34 layers: 12 nodes or more cannot hold 3 chunks each


def test_a_node_that_cannot_hold_the_chunks_in_flight_keeps_v_1() -> None:
    tight = ClusterSpec(model="tiny", nodes=4, global_batch=8, microbatch=1, device_memory_gib=0.02, shape=None,
                        virtual_stages=2)
    templates = cluster_templates(tight)
    base = cluster_templates(ClusterSpec(model="tiny", nodes=4, global_batch=8, microbatch=1,
                                         device_memory_gib=0.02, virtual_stages=1))
    costs = StageCosts(base.profile, 1, "auto")
    refused = [n for n, t in base.templates.items() if n >= 2 and interleave_template(t, costs, 2) is None]
    assert refused, "the budget should leave some template without room for 2 chunks"
    assert all(templates.templates[n].virtual_stages == 1 for n in refused)
    assert best_interleaving(base.templates[base.sizes[0]], costs, 1) is base.templates[base.sizes[0]]


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_chunks_memory_counts_each_chunks_bytes_and_one_rerun_workspace(mode: str) -> None:
    """A node's chunks against the profile, layer by layer: each chunk's weights, gradients,
    moments, layer workspace and in-flight activations (its output too unless it is the last
    virtual stage), plus the largest workspace a rerun brings back, once: a node runs one
    chunk's backward at a time."""
    profile = cluster_templates(ClusterSpec(model="gpt2-124m", nodes=4, global_batch=8, microbatch=1)).profile
    costs = StageCosts(profile, 1, mode)
    grad = profile.memory.grad_bytes_per_param / 4
    for ranges, in_flight_, last in [(((1, 4), (7, 10)), (3, 1), False), (((0, 3), (6, 9), (10, 14)), (2, 2, 1), True)]:
        want, rerun = 0.0, 0.0
        for c, (first, last_layer) in enumerate(ranges):
            layers = profile.layers[first:last_layer]
            want += sum(ly.param_bytes * (1 + grad) + ly.optimizer_bytes + ly.workspace_bytes for ly in layers)
            keeps_output = not (last and c == len(ranges) - 1)
            want += in_flight_[c] * (sum(ly.under(mode).activation_bytes for ly in layers)
                                     + (layers[-1].output_bytes if keeps_output else 0))
            rerun = max(rerun, *(ly.under(mode).workspace_bytes for ly in layers))
        assert costs.chunks_memory(ranges, mode, in_flight_, last) == pytest.approx(want + rerun, rel=1e-12)
