"""Profiles: JSON format and validation, derived counts, and `elastic profile` on this machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic.cli.main import main
from elastic.model.config import get_preset
from elastic.planning.cluster import gpt_layer_counts
from templates.derive import DeviceSpeed, derive_profile
from templates.profile import Profile, ProfileError


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
    blocks = profile.layers[1:-1]
    # A block saves far more than its output for backward (attention scores, MLP inputs).
    assert all(b.activation_bytes > 4 * b.output_bytes for b in blocks)
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
