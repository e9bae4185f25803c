"""Model shapes from the command line: preset, then `--model-config FILE`, then single fields;
the planner, the profile and the simulator follow the shape; the JobSpec carries it; bad shapes
are one line, exit 2 (through the CLI)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from elastic.cli.main import main
from elastic.cli.model_flags import add_shape_flags, model_from_flags
from elastic.model.config import GPTConfig, get_preset
from elastic.planning.cluster import ClusterSpec, cluster_profile
from elastic.records.job import JobSpec, shape_of_spec
from templates.plan import even_plan

pytestmark = pytest.mark.timeout(60)

PLAN = ["plan", "--model", "tiny", "--nodes", "2", "--global-batch", "8", "--microbatch", "2"]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    add_shape_flags(parser)
    return parser.parse_args(argv)


def test_flags_apply_over_the_file_over_the_preset(tmp_path: Path) -> None:
    config = tmp_path / "model.json"
    config.write_text(json.dumps({"n_layer": 3, "d_model": 96, "n_head": 6, "dropout": 0, "init_seed": 7}))
    cfg = model_from_flags(_args("--model", "small", "--model-config", str(config), "--n-head", "3"))
    small = get_preset("small")
    assert cfg == GPTConfig(vocab_size=small.vocab_size, seq_len=small.seq_len, n_layer=3, n_head=3, d_model=96,
                            dropout=0.0, init_seed=7)
    assert model_from_flags(_args()) == get_preset("tiny")
    # a derived default (the vocabulary of prepared data) fills only what neither file nor flag sets
    assert model_from_flags(_args(), defaults={"vocab_size": 1000}).vocab_size == 1000
    assert model_from_flags(_args("--vocab-size", "512"), defaults={"vocab_size": 1000}).vocab_size == 512
    config.write_text(json.dumps({"vocab_size": 640}))
    assert model_from_flags(_args("--model-config", str(config)), defaults={"vocab_size": 1000}).vocab_size == 640


def test_a_llama_shape_from_a_file_and_flags(tmp_path: Path) -> None:
    config = tmp_path / "model.json"
    config.write_text(json.dumps({"arch": "llama", "n_kv_heads": 2, "rope_theta": 500000, "norm_eps": 1e-6}))
    cfg = model_from_flags(_args("--model-config", str(config), "--ffn-hidden", "320"))
    assert (cfg.arch, cfg.kv_heads, cfg.d_ff, cfg.rope_theta, cfg.norm_eps) == ("llama", 2, 320, 500000.0, 1e-6)
    plan = even_plan(num_layers=cfg.num_layers, nodes=[0], num_pipelines=1, global_microbatches=2, microbatch_size=2)
    spec = JobSpec(model="tiny", plan=plan, steps=3, run_dir="/r", shape=cfg)
    assert JobSpec.from_json(spec.to_json()).model_config == cfg


def test_the_job_spec_carries_the_shape() -> None:
    cfg = GPTConfig(vocab_size=300, seq_len=32, n_layer=2, n_head=2, d_model=64)
    plan = even_plan(num_layers=cfg.num_layers, nodes=[0], num_pipelines=1, global_microbatches=2, microbatch_size=2)
    spec = JobSpec(model="tiny", plan=plan, steps=3, run_dir="/r", shape=cfg)
    again = JobSpec.from_json(spec.to_json())
    assert again == spec and again.model_config == cfg
    assert shape_of_spec(json.loads(spec.to_json())) == cfg
    assert shape_of_spec({"model": "tiny"}) == get_preset("tiny")  # a job file written before shapes
    with pytest.raises(ValueError, match="plan has 6 layers but model 'tiny' has 4"):
        JobSpec(model="tiny", plan=even_plan(num_layers=6, nodes=[0], num_pipelines=1, global_microbatches=2,
                                             microbatch_size=2), steps=3, run_dir="/r", shape=cfg)


def test_planner_profile_and_simulator_follow_the_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN, "--json", "--n-layer", "7", "--d-model", "64"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["num_layers"] == 9 and out["shape"]["n_layer"] == 7 and out["shape"]["d_model"] == 64
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=7, n_head=4, d_model=64)
    spec = ClusterSpec(model="tiny", nodes=2, shape=cfg)
    assert [layer.param_bytes for layer in cluster_profile(spec).layers] == [4 * cfg.layer_param_count(i) for i in range(9)]
    assert spec.label == "tiny (n_layer=7, d_model=64)"
    profile = tmp_path / "profile.json"
    assert main(["profile", "--model", "tiny", "--microbatch", "2", "--mode", "derive", "--n-layer", "7",
                 "--d-model", "64", "--output", str(profile)]) == 0
    assert len(json.loads(profile.read_text())["layers"]) == 9
    assert main([*PLAN, "--profile", str(profile), "--n-layer", "7", "--d-model", "64"]) == 0
    capsys.readouterr()
    assert main([*PLAN, "--profile", str(profile)]) == 2  # a profile of another shape
    assert "has 9 layers but tiny has 6" in capsys.readouterr().err
    assert main(["simulate", "--model", "gpt3-350m", "--n-layer", "2", "--nodes", "4", "--trace", "every=1h,min=2",
                 "--hours", "2", "--global-batch", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cluster"]["shape"]["n_layer"] == 2


@pytest.mark.parametrize(
    ("flags", "config", "message"),
    [
        (["--n-head", "5"], None, "model shape: d_model=128 is not divisible by n_head=5"),
        (["--n-layer", "0"], None, "GPTConfig.n_layer must be positive, got 0"),
        (["--vocab-size", "-3"], None, "GPTConfig.vocab_size must be positive, got -3"),
        (["--gpus-per-node", "2", "--n-head", "3", "--d-model", "96"], None,
         "n_head=3 is not divisible by --gpus-per-node 2"),
        ([], {"n_layers": 2}, "unknown field(s) 'n_layers'"),
        ([], {"d_model": "wide"}, "d_model must be an integer, got 'wide'"),
        ([], {"n_layer": 2.5}, "n_layer must be an integer"),
        ([], [2, 64], "expected a JSON object of GPTConfig fields"),
        ([], "{not json", "not valid JSON"),
        (["--model", "nope"], None, "unknown model preset 'nope'"),
        ([], {"arch": "bert"}, "arch is one of gpt2, llama, got 'bert'"),
        ([], {"arch": 2}, "arch must be a string (gpt2, llama), got 2"),
        (["--n-kv-heads", "2"], None, "grouped-query attention and other MLP widths are arch llama's"),
        ([], {"arch": "llama", "n_kv_heads": 3}, "n_head=4 is not divisible by n_kv_heads=3"),
        (["--model", "llama-tiny", "--n-head", "6", "--n-kv-heads", "3", "--d-model", "96", "--gpus-per-node", "2"], None,
         "n_kv_heads=3 and --gpus-per-node 2 do not divide one another"),
        ([], {"arch": "llama", "rope_theta": "high"}, "rope_theta must be a number, got 'high'"),
        ([], {"qkv_bias": True}, "qkv_bias is arch llama's"),
        ([], {"arch": "llama", "qkv_bias": 1}, "qkv_bias must be true or false, got 1"),
    ],
)
def test_bad_shapes_are_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], config: object, message: str
) -> None:
    argv = [*PLAN, *flags]
    if config is not None:
        path = tmp_path / "model.json"
        path.write_text(config if isinstance(config, str) else json.dumps(config))
        argv += ["--model-config", str(path)]
    for command in (argv, ["simulate", *argv[1:3], "--nodes", "2", "--trace", "every=1h,min=1", "--hours", "1",
                           *argv[9:]]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
