"""Profiles: JSON format and validation, derived counts, and `elastic profile` on this machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic.cli.main import main
from elastic.model.config import get_preset
from elastic.planning.cluster import ClusterSpec, cluster_profile, gpt_layer_counts
from templates.cost import StageCosts
from templates.derive import DeviceSpeed, derive_profile
from templates.profile import MemoryModel, Profile, ProfileError


def tiny_derived() -> Profile:
    cfg = get_preset("tiny")
    return derive_profile(
        model="tiny",
        layers=gpt_layer_counts(cfg),
        seq_len=cfg.seq_len,
        microbatch_size=2,
        device=DeviceSpeed(flops_per_second=1e12, memory_bytes=2**30),
    )


@pytest.mark.timeout(30)
def test_round_trip_and_validation() -> None:
    profile = tiny_derived()
    assert Profile.from_json(profile.to_json()) == profile
    data = json.loads(profile.to_json())
    data["version"] = 99
    with pytest.raises(ProfileError, match="unsupported profile version 99"):
        Profile.from_dict(data)
    data = json.loads(profile.to_json())
    data["layers"][2]["backward"] = -1.0
    with pytest.raises(ProfileError, match="layer 2 backward time must be a number >= 0"):
        Profile.from_dict(data)
    data = json.loads(profile.to_json())
    del data["device"]["p2p_bandwidth"]
    with pytest.raises(ProfileError, match="missing field 'p2p_bandwidth'"):
        Profile.from_dict(data)
    with pytest.raises(ProfileError, match="not valid JSON"):
        Profile.from_json("{")
    data = json.loads(profile.to_json())
    data["device"]["reserve_bytes"] = data["device"]["memory_bytes"]
    with pytest.raises(ProfileError, match="reserve_bytes must be >= 0 and below memory_bytes"):
        Profile.from_dict(data)


@pytest.mark.timeout(30)
def test_a_profile_without_memory_figures_reads_with_the_old_model() -> None:
    """A file from before the memory model: one fp32 gradient per parameter, no reserve, no
    workspace, no fixed buffers; the stage memory is what it always was."""
    profile = tiny_derived()
    data = json.loads(profile.to_json())
    del data["memory"], data["device"]["reserve_bytes"]
    for layer in data["layers"]:
        del layer["workspace_bytes"]
    old = Profile.from_dict(data)
    assert old.memory == MemoryModel() and old.device.reserve_bytes == 0
    costs = StageCosts(old, 1)
    first, last = 0, old.num_layers
    layers = old.layers[first:last]
    expected = sum(2 * ly.param_bytes + ly.optimizer_bytes + ly.activation_bytes for ly in layers)
    assert costs.stage_memory(first, last, 1) == expected and costs.capacity == old.device.memory_bytes


@pytest.mark.timeout(30)
def test_derived_counts() -> None:
    cfg = get_preset("tiny")
    profile = tiny_derived()
    tokens = cfg.seq_len * 2
    for i, layer in enumerate(profile.layers):
        assert layer.param_bytes == 4 * cfg.layer_param_count(i)
        assert layer.optimizer_bytes == 2 * layer.param_bytes
        assert layer.forward == pytest.approx(cfg.layer_flops_per_token(i) * tokens / 1e12)
        assert layer.backward == pytest.approx(2 * layer.forward)
    assert profile.source == "derived" and "derived from FLOP/byte counts" in profile.notes


@pytest.mark.timeout(120)
def test_measured_profile_of_tiny_feeds_the_planner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = get_preset("tiny")
    path = tmp_path / "tiny.json"
    argv = ["profile", "--model", "tiny", "--microbatch", "1", "--repeats", "1", "--device", "cpu"]
    assert main([*argv, "--mode", "measure", "--output", str(path)]) == 0
    profile = Profile.load(path)
    assert profile.source == "measured" and profile.num_layers == cfg.num_layers
    for i, layer in enumerate(profile.layers):
        # Sizes are measured from the real modules: they must match the config's counts.
        assert layer.param_bytes == 4 * cfg.layer_param_count(i)
        assert layer.forward > 0 and layer.backward > 0
    # The head's loss workspace (fp32 on CPU: 16 B per logit); no reserve on CPU.
    assert profile.layers[-1].workspace_bytes == cfg.seq_len * cfg.vocab_size * 16
    assert profile.device.reserve_bytes == 0 and "fp32" in profile.notes
    blocks = profile.layers[1:-1]
    # A block saves far more than its output for backward (attention scores, MLP inputs).
    assert all(b.activation_bytes > 4 * b.output_bytes for b in blocks)
    # Each block under each recomputation mode: the memory model's bytes, measured times.
    derived = cluster_profile(ClusterSpec(model="tiny", nodes=1, global_batch=1, microbatch=1))
    for measured, counted in zip(blocks, derived.layers[1:-1], strict=True):
        assert set(measured.recompute) == {"selective", "full"}
        for mode in ("selective", "full"):
            assert measured.recompute[mode].activation_bytes == counted.recompute[mode].activation_bytes
            assert measured.recompute[mode].allreduces == counted.recompute[mode].allreduces
        # times measured under whatever load the machine has: positive, never compared (a
        # loaded CI machine timed selective's part above the whole forward once)
        assert measured.recompute["selective"].extra > 0 and measured.recompute["full"].extra == measured.forward
        assert measured.recompute["full"].workspace_bytes == measured.activation_bytes
    assert not profile.layers[0].recompute and not profile.layers[-1].recompute
    capsys.readouterr()
    code = main(
        ["plan", "--model", "tiny", "--nodes", "4", "--fault-tolerance", "1", "--global-batch", "8",
         "--microbatch", "1", "--profile", str(path), "--json"]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert len(json.loads(out)["plan"]["pipelines"]) >= 2


@pytest.mark.timeout(60)
def test_large_model_profile_is_derived_from_measured_speed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--model", "gpt3-6.7b", "--microbatch", "1", "--device", "cpu"]) == 0
    profile = Profile.from_json(capsys.readouterr().out)
    assert profile.source == "derived"
    assert "measured fp32 matmul speed" in profile.notes


@pytest.mark.timeout(30)
def test_bad_profile_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--model", "tiny", "--microbatch", "0"]) == 2
    assert "--microbatch must be >= 1" in capsys.readouterr().err
    assert main(["profile", "--model", "huge", "--microbatch", "1"]) == 2
    assert "unknown model preset 'huge'" in capsys.readouterr().err
