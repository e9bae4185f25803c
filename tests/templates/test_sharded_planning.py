"""The planner with the optimizer sharded (issue 55): templates that count 1/S of each layer's
moments, plans that keep the S they assumed, and `auto` choosing sharding only where it lays a
faster plan at f >= 1. Each sharded plan is checked against the unsharded plan of the same
cluster, computed on its own."""

from __future__ import annotations

import dataclasses
import json

import pytest

from elastic.cli.main import main
from elastic.planning.cluster import ClusterSpec, cluster_templates, initial_plan
from elastic.planning.optimizer_choice import choose_plan, gather_time, sharded_plan
from templates.cost import MOMENT_GRID_BYTES, StageCosts, moment_bytes
from templates.template_set import TemplateSet

pytestmark = pytest.mark.timeout(120)

GPT3_CPU = ClusterSpec(model="gpt3-1.3b", nodes=32, gpus_per_node=1, fault_tolerance=1, global_batch=512,
                       microbatch=4, device_memory_gib=24, device_tflops=300)
"""A cluster where the memory sharding frees buys a faster layout (fp32 activations on 24 GiB)."""


def test_a_holder_counts_its_slice_of_the_moments() -> None:
    assert moment_bytes(8000.0, 1) == 8000.0
    assert moment_bytes(8e6, 4) == 2e6 + MOMENT_GRID_BYTES
    assert moment_bytes(100.0, 4) == 100.0  # never more than the whole
    whole = StageCosts(cluster_templates(GPT3_CPU).profile, 1)
    half = StageCosts(whole.profile, 1, moment_slices=2)
    layers = whole.profile.layers
    freed = sum(ly.optimizer_bytes - moment_bytes(ly.optimizer_bytes, 2) for ly in layers)
    assert whole.state_bytes(0, len(layers)) - half.state_bytes(0, len(layers)) == pytest.approx(freed, rel=1e-12)
    with pytest.raises(ValueError, match="moment_slices"):
        StageCosts(whole.profile, 1, moment_slices=0)


def test_the_sharded_plan_keeps_the_slices_it_assumed_and_beats_the_unsharded_one() -> None:
    whole = cluster_templates(GPT3_CPU)
    plain = initial_plan(GPT3_CPU, whole)
    tset, plan = sharded_plan(GPT3_CPU, (whole, plain))
    f = GPT3_CPU.fault_tolerance
    assert len(plan.pipelines) // (f + 1) >= tset.moment_slices > 1
    assert plan.iteration_time < plain.iteration_time
    assert plan != plain  # the freed memory laid another layout
    recomputing = [sum(st.recompute != "none" for pipe in p.pipelines for st in pipe.stages) for p in (plan, plain)]
    assert recomputing[0] < recomputing[1] or len(plan.pipelines) > len(plain.pipelines), recomputing
    chosen = choose_plan(GPT3_CPU, "auto")
    assert chosen.sharded and chosen.plan == plan and chosen.unsharded_time == plain.iteration_time
    assert 0 < chosen.gather_time == gather_time(tset, plan) and plan.iteration_time + chosen.gather_time < plain.iteration_time


def test_auto_counts_the_gather_against_the_layout_it_buys() -> None:
    """gpt3-6.7b on 64 x 1 fp32 80 GiB: sharded lays 6 pipelines for 4 and predicts a faster
    iteration, but the gather of (S - 1) / S of a stage's parameters, less what the first forward
    hides, costs more than it saves: `auto` stays unsharded."""
    spec = ClusterSpec(model="gpt3-6.7b", nodes=64, gpus_per_node=1, fault_tolerance=1, global_batch=1024,
                       microbatch=4, device_memory_gib=80, device_tflops=300)
    on, auto = choose_plan(spec, "on"), choose_plan(spec, "auto")
    assert on.sharded and on.plan.iteration_time < on.unsharded_time < on.plan.iteration_time + on.gather_time
    assert not auto.sharded and auto.plan.iteration_time == on.unsharded_time


@pytest.mark.parametrize("mode", ["off", "on", "auto"])
def test_f0_is_never_sharded_by_auto_and_off_is_the_unsharded_plan(mode: str) -> None:
    spec = ClusterSpec(model="gpt3-6.7b", nodes=64, gpus_per_node=1, fault_tolerance=0, global_batch=1024,
                       microbatch=4, device_memory_gib=80, device_tflops=300)
    chosen = choose_plan(spec, mode)
    assert chosen.sharded == (mode == "on")
    if mode != "on":
        assert chosen.plan == initial_plan(spec, cluster_templates(spec))
    with pytest.raises(ValueError, match="--shard-optimizer"):
        choose_plan(spec, "sometimes")


def test_auto_leaves_a_plan_that_memory_does_not_bind(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "gpt3-350m", "--nodes", "8", "--fault-tolerance", "1", "--global-batch", "64",
            "--microbatch", "2", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["optimizer"]["sharded"] is False and data["optimizer"]["slices"] == 1
    assert data["optimizer"]["unsharded_iteration_time"] == data["plan"]["iteration_time"]
    assert main([*argv[:-1], "--shard-optimizer", "on", "--json"]) == 0
    on = json.loads(capsys.readouterr().out)["optimizer"]
    pipelines = len(data["plan"]["pipelines"])
    assert on["sharded"] is True and on["slices"] == pipelines // 2 and on["owners_per_slice"] == 2
    assert main([*argv[:-1], "--shard-optimizer", "on"]) == 0
    assert f"sharded: each layer's moments in {pipelines // 2} slice(s)" in capsys.readouterr().out


def test_the_gather_waits_only_for_what_the_first_forward_does_not_hide() -> None:
    """`gather_time` against its two ends, on the 1.3b plan with its layers' forward times
    changed: with no forward to hide behind, the whole transfer of the largest stage's (S - 1) / S
    (the gather waited for whole, as before the overlap); with every layer's forward longer than
    the whole transfer, only the first layer's share; in between, between the two."""
    tset, plan = sharded_plan(GPT3_CPU, None) or pytest.fail("no sharded plan")
    s = len(plan.pipelines) // (GPT3_CPU.fault_tolerance + 1)
    profile, device = tset.profile, tset.profile.device
    stages = [[i for a, b in st.ranges for i in range(a, b)] for pipe in plan.pipelines for st in pipe.stages]

    def share(layers: list[int]) -> float:
        return sum(profile.layers[i].param_bytes for i in layers) * (s - 1) / s

    def with_forward(seconds: float | None) -> TemplateSet:
        layers = [ly if seconds is None else dataclasses.replace(ly, forward=seconds) for ly in profile.layers]
        return dataclasses.replace(tset, profile=dataclasses.replace(profile, layers=layers))

    whole = max(device.p2p_time(share(st)) for st in stages)
    assert gather_time(with_forward(0.0), plan) == pytest.approx(whole, rel=1e-12)
    first = max(device.p2p_time(share(st[:1])) for st in stages)
    assert gather_time(with_forward(10 * whole), plan) == pytest.approx(first, rel=1e-12)
    assert first < gather_time(with_forward(None), plan) < whole
