"""The planner's recomputation trade (issue 54): each stage's mode is the fastest that fits, its
costs are the forced modes', a profile and a plan carry the modes and refuse bad ones.

Exactness against exhaustive search over every split and every stage's every mode is
tests/templates/test_search.py; what each mode keeps, against what autograd saves in a real
Trainer step, is tests/engine/test_saved_activations.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.planning.cluster import ClusterSpec, cluster_profile, cluster_templates, initial_plan
from templates.cost import StageCosts
from templates.plan import Plan, PlanError
from templates.profile import RECOMPUTE_MODES, Profile, ProfileError
from templates.template_set import PlanningError
from tests.templates.helpers import SLOW_OR_FILTERED, profiles

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


@settings(max_examples=60, deadline=None, suppress_health_check=SLOW_OR_FILTERED)
@given(profile=profiles(max_layers=8), gpus=st.sampled_from([1, 2, 4]))
def test_auto_costs_are_the_fastest_forced_mode_that_fits(profile: Profile, gpus: int) -> None:
    auto = StageCosts(profile, gpus, "auto")
    forced = {mode: StageCosts(profile, gpus, mode) for mode in RECOMPUTE_MODES}
    n = profile.num_layers
    for k in range(1, n + 1):
        expected = np.minimum.reduce([costs.costs(k) for costs in forced.values()])
        np.testing.assert_array_equal(auto.costs(k), expected)
        for first in range(n):
            for last in range(first + 1, n + 1):
                if not np.isfinite(expected[first, last]):
                    continue
                mode = auto.stage_mode(first, last, k)
                assert forced[mode].stage_fits(first, last, k)
                assert auto.stage_time(first, last, k) == forced[mode].stage_time(first, last, k)
                # the first of none, selective, full on ties: nothing recomputed for nothing
                faster = [m for m in RECOMPUTE_MODES[: RECOMPUTE_MODES.index(mode)]
                          if forced[m].costs(k)[first, last] <= forced[mode].costs(k)[first, last]]
                assert not faster, (first, last, k, mode, faster)


def _spec(**changes: object) -> ClusterSpec:
    fields: dict[str, object] = dict(model="gpt3-6.7b", nodes=64, gpus_per_node=1, fault_tolerance=1,
                                     global_batch=512, microbatch=4, device_memory_gib=80.0)
    fields.update(changes)
    return ClusterSpec(**fields)  # type: ignore[arg-type]


def test_with_room_to_spare_auto_plans_as_without_recomputation() -> None:
    """gpt2-124m in 80 GiB: recomputation would only cost time, so no stage takes it and the
    plan is the one planned without it."""
    spec = dict(model="gpt2-124m", nodes=8, gpus_per_node=2, fault_tolerance=1, global_batch=64, microbatch=4)
    none = ClusterSpec(**spec, recompute="none")  # type: ignore[arg-type]
    auto = ClusterSpec(**spec)  # type: ignore[arg-type]
    assert auto.recompute == "auto"
    assert initial_plan(auto, cluster_templates(auto)) == initial_plan(none, cluster_templates(none))


def test_recomputation_fits_a_model_that_did_not() -> None:
    """gpt3-6.7b, 64 nodes x 1 device of 80 GiB, microbatch 4, fp32 activations, f = 4: without
    recomputation a pipeline needs 15 nodes and five do not fit in 64; with it they do, and the
    plan says which stages recompute."""
    with pytest.raises(PlanningError, match="fault tolerance 4 needs 5 pipelines of at least 15 nodes"):
        cluster_templates(_spec(fault_tolerance=4, recompute="none"))
    spec = _spec(fault_tolerance=4)
    tset = cluster_templates(spec)
    plan = initial_plan(spec, tset)
    modes = {st.recompute for pipe in plan.pipelines for st in pipe.stages}
    assert len(plan.pipelines) >= 5 and "full" in modes
    costs = StageCosts(tset.profile, 1, "auto")
    for pipe in plan.pipelines:
        depth = len(pipe.stages)
        for s, stage in enumerate(pipe.stages):
            assert stage.recompute == costs.stage_mode(stage.first, stage.last, depth - s)
            assert StageCosts(tset.profile, 1, stage.recompute).stage_fits(stage.first, stage.last, depth - s)


def test_auto_is_never_predicted_slower_than_without() -> None:
    """gpt3-6.7b on 64 nodes, 1 and 8 devices each, CPU (fp32) and CUDA (bf16) activations."""
    for gpus in (1, 8):
        for device_type in ("cpu", "cuda"):
            none, auto = (_spec(gpus_per_node=gpus, device_type=device_type, recompute=r) for r in ("none", "auto"))
            t_none = initial_plan(none, cluster_templates(none)).iteration_time
            t_auto = initial_plan(auto, cluster_templates(auto)).iteration_time
            assert t_auto <= t_none * (1 + 1e-12), (gpus, device_type)


def test_a_forced_mode_applies_to_every_stage() -> None:
    for mode in RECOMPUTE_MODES:
        spec = _spec(nodes=40, recompute=mode)
        plan = initial_plan(spec, cluster_templates(spec))
        assert {st.recompute for pipe in plan.pipelines for st in pipe.stages} == {mode}


def test_profiles_and_plans_carry_the_modes_and_refuse_bad_ones() -> None:
    profile = cluster_profile(_spec())
    again = Profile.from_json(profile.to_json())
    assert again == profile and set(again.layers[1].recompute) == {"selective", "full"}
    assert not again.layers[0].recompute and again.layers[0].under("full").activation_bytes == \
        profile.layers[0].activation_bytes
    data = json.loads(profile.to_json())
    for layer in data["layers"]:
        layer.pop("recompute", None)
    old = Profile.from_dict(data)  # written before the modes: every layer keeps everything
    assert all(ly.under(m).activation_bytes == ly.activation_bytes for ly in old.layers for m in RECOMPUTE_MODES)
    bad = json.loads(profile.to_json())
    bad["layers"][1]["recompute"]["partial"] = bad["layers"][1]["recompute"]["full"]
    with pytest.raises(ProfileError, match="recompute mode must be one of"):
        Profile.from_dict(bad)
    bad = json.loads(profile.to_json())
    bad["layers"][1]["recompute"]["full"]["activation_bytes"] = -1
    with pytest.raises(ProfileError, match="recompute 'full' figures must be >= 0"):
        Profile.from_dict(bad)
    bad = json.loads(profile.to_json())
    del bad["layers"][1]["recompute"]["full"]["extra"]
    with pytest.raises(ProfileError, match="missing field 'extra'"):
        Profile.from_dict(bad)

    spec = _spec(fault_tolerance=4)
    plan = initial_plan(spec, cluster_templates(spec))
    assert Plan.from_json(plan.to_json()) == plan
    data = json.loads(plan.to_json())
    data["pipelines"][0]["stages"][0]["recompute"] = "some"
    with pytest.raises(PlanError, match="pipeline 0 stage 0 recompute must be one of none, selective, full"):
        Plan.from_dict(data)
    for pipe in data["pipelines"]:
        for stage in pipe["stages"]:
            del stage["recompute"]
    assert {st.recompute for p in Plan.from_dict(data).pipelines for st in p.stages} == {"none"}


def test_as_fast_without_recomputation_is_chosen_without_it() -> None:
    """gpt3-6.7b, 64 nodes x 1 CUDA device, f = 1: recomputation lets a pipeline of 9-12 nodes
    exist, but no plan with one is faster than the best plan without: that plan is chosen."""
    auto, none = _spec(device_type="cuda"), _spec(device_type="cuda", recompute="none")
    tset = cluster_templates(auto)
    assert any("full" in t.stage_modes for t in tset.templates.values())
    assert initial_plan(auto, tset) == initial_plan(none, cluster_templates(none))


def test_the_planning_bench_reports_both_predictions(tmp_path: Path) -> None:
    out = tmp_path / "planning.json"
    proc = subprocess.run([sys.executable, "-m", "bench.recompute_planning", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    by = {(r["gpus_per_node"], r["device"], r["f"], r["recompute"]): r for r in rows}
    for (gpus, device, f, mode), row in by.items():
        if mode == "auto":
            base = by[(gpus, device, f, "none")]
            assert row["plan"] is not None
            assert base["plan"] is None or row["step_s"] <= base["step_s"] * (1 + 1e-9)
    assert by[(1, "cpu", 4, "none")]["plan"] is None and by[(8, "cuda", 1, "auto")]["stages"] == {"none": 64}
