"""`elastic plan` through elastic.cli.main.main: JSON contract, table, profile files, bad arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic.cli.main import main
from elastic.model.config import get_preset
from elastic.planning.cluster import derived_profile
from templates.derive import DeviceSpeed
from templates.plan import Plan

BASE = ["plan", "--model", "gpt3-350m", "--nodes", "8", "--gpus-per-node", "2", "--global-batch", "64"]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.timeout(60)
def test_json_has_the_contract_fields(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run([*BASE, "--microbatch", "2", "--fault-tolerance", "1", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["templates"], "at least one template"
    for template in data["templates"]:
        assert len(template["stages"]) == template["nodes"]
        assert template["stages"][0]["layers"][0] == 0 and template["stages"][-1]["layers"][1] == 26
        assert template["iteration_time"] > 0
    plan = data["plan"]
    assert len(plan["pipelines"]) >= 2
    assert sorted(n for p in plan["pipelines"] for n in p["nodes"]) == list(range(8))
    assert sum(p["microbatches"] for p in plan["pipelines"]) == 32
    for pipe in plan["pipelines"]:
        assert pipe["nodes"] == [s["node"] for s in pipe["stages"]]
    assert plan["iteration_time"] == max(p["iteration_time"] for p in plan["pipelines"])
    Plan.from_dict(plan)  # the engine can load it as is


@pytest.mark.timeout(60)
def test_table_and_measured_profile_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A profile file with a 4x slower device: same layout choices scale, times are 4x.
    slow = derived_profile(
        "gpt3-350m", get_preset("gpt3-350m"), 2, DeviceSpeed(flops_per_second=25e12, memory_bytes=80 * 2**30)
    )
    path = tmp_path / "profile.json"
    slow.save(path)
    code, out, _ = run([*BASE, "--microbatch", "2", "--json"], capsys)
    fast_time = json.loads(out)["plan"]["iteration_time"]
    code, out, err = run([*BASE, "--microbatch", "2", "--json", "--profile", str(path)], capsys)
    assert code == 0, err
    slow_time = json.loads(out)["plan"]["iteration_time"]
    assert slow_time > 2 * fast_time
    code, out, err = run([*BASE, "--microbatch", "2"], capsys)
    assert code == 0 and "plan:" in out and "templates for n in" in out and "iteration" in out
    # A profile taken at another microbatch size is refused.
    code, _, err = run([*BASE, "--microbatch", "4", "--profile", str(path)], capsys)
    assert code == 2 and "microbatch 2, not 4" in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*BASE, "--microbatch", "3"], "--microbatch 3 does not divide --global-batch 64"),
        (["plan", "--model", "gpt9", "--nodes", "4", "--global-batch", "8", "--microbatch", "2"], "unknown model preset"),
        ([*BASE, "--microbatch", "2", "--fault-tolerance", "8"], "needs at least 9 nodes"),
        ([*BASE, "--microbatch", "0"], "--microbatch must be >= 1"),
        ([*BASE, "--microbatch", "2", "--fault-tolerance", "-1"], "--fault-tolerance must be >= 0"),
        ([*BASE, "--microbatch", "32", "--fault-tolerance", "2"], "2 microbatches (64/32) cannot feed the 3 pipelines"),
        ([*BASE, "--microbatch", "2", "--device-tflops", "nan"], "--device-tflops must be a positive number"),
        ([*BASE, "--microbatch", "2", "--profile", "/nonexistent.json"], "cannot read profile"),
        ([*BASE, "--microbatch", "2", "--device", "cuda", "--device-memory-gib", "0.5"],
         "leaves nothing beside the 1 GiB reserve of a cuda device"),
        (
            ["plan", "--model", "gpt3-6.7b", "--nodes", "4", "--gpus-per-node", "8", "--fault-tolerance", "3",
             "--global-batch", "64", "--microbatch", "8", "--device-memory-gib", "20", "--recompute", "none"],
            "fault tolerance 3 needs 4 pipelines of at least 3 nodes = 12 nodes, but the cluster has 4",
        ),
        (  # recomputation fits the model in fewer nodes, not yet in one
            ["plan", "--model", "gpt3-6.7b", "--nodes", "4", "--gpus-per-node", "8", "--fault-tolerance", "3",
             "--global-batch", "64", "--microbatch", "8", "--device-memory-gib", "20"],
            "fault tolerance 3 needs 4 pipelines of at least 2 nodes = 8 nodes, but the cluster has 4",
        ),
    ],
)
def test_bad_arguments_one_line_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(argv, capsys)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.timeout(60)
def test_a_plan_for_cuda_workers(capsys: pytest.CaptureFixture[str]) -> None:
    """--device cuda: bf16 activations and a reserve per device, whether or not this machine has a
    GPU (without one, and without --device-memory-gib, the nominal device's memory)."""
    code, out, err = run([*BASE, "--microbatch", "2", "--device", "cuda", "--device-memory-gib", "16", "--json"], capsys)
    assert code == 0, err
    cuda = json.loads(out)
    code, out, err = run([*BASE, "--microbatch", "2", "--device-memory-gib", "16", "--json"], capsys)
    assert code == 0, err
    cpu = json.loads(out)
    assert "nominal cuda device" in cuda["profile"]["notes"] and "nominal cpu device" in cpu["profile"]["notes"]
    assert "2-byte activations" in cuda["profile"]["notes"] and "4-byte activations" in cpu["profile"]["notes"]
    code, out, err = run([*BASE, "--microbatch", "2", "--device", "cuda", "--json"], capsys)
    assert code == 0, err


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("argv", "why"), [
    (["--model", "llama3-8b", "--nodes", "16", "--gpus-per-node", "8", "--device", "cuda", "--device-memory-gib", "80",
      "--global-batch", "512", "--microbatch", "1"], "llama, 2-stage pipelines"),
    (["--model", "llama3-70b", "--nodes", "64", "--gpus-per-node", "8", "--device", "cuda", "--device-memory-gib", "80",
      "--global-batch", "512", "--microbatch", "1"], "heterogeneous pipelines of 17-24 stages, recomputation"),
    (["--model", "gpt3-6.7b", "--nodes", "24", "--gpus-per-node", "1", "--device-memory-gib", "80", "--global-batch",
      "96", "--microbatch", "4"], "fp32, TP 1, full recomputation on some stages"),
    (["--model", "gpt3-1.3b", "--nodes", "8", "--device-memory-gib", "40", "--global-batch", "64", "--microbatch", "2",
      "--virtual-stages", "2"], "interleaved: 2 pipelines of 4 nodes, v = 2"),
    (["--model", "gpt3-1.3b", "--nodes", "32", "--device-memory-gib", "24", "--global-batch", "64", "--microbatch", "2",
      "--shard-optimizer", "on"], "the sharded optimizer"),
])
def test_the_plans_largest_worker_fits_the_device(argv: list[str], why: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`elastic plan`'s memory figure is the memory model's (`worker_memory`, equal to a real
    Trainer's bytes: tests/engine/test_memory_model.py) for the plan's every worker; the templates
    were chosen by the profile's memory check, a bound on the same model for even batch splits
    (these plans'): the two agree that every worker fits, and the table prints the same figure
    (with no warning)."""
    code, out, err = run(["plan", *argv, "--fault-tolerance", "1", "--json"], capsys)
    assert code == 0, err
    memory = json.loads(out)["memory"]
    assert 0 < memory["largest_worker_bytes"] <= memory["device_memory_bytes"], (why, memory)
    assert memory["largest_worker_bytes"] == sum(memory[k] for k in ("params_and_state", "activations", "head", "reserve"))
    code, out, err = run(["plan", *argv, "--fault-tolerance", "1"], capsys)
    assert f"memory: largest worker {memory['largest_worker_bytes'] / 2**30:.2f} GiB" in out
    assert memory["fits"] and "WARNING" not in out


@pytest.mark.timeout(60)
def test_a_plan_over_the_device_by_the_memory_model_is_planned_again(capsys: pytest.CaptureFixture[str]) -> None:
    """tiny on 5 nodes at 0.034 GiB: the planner's first plan (pipelines of 3 and 2 nodes taking
    3 and 5 of the 8 microbatches) leaves the second's last stage over the device by the memory
    model (its share of the summation tree is 2 blocks, the even split's 1); the plan printed is
    made again with the excess held back, fits, and says so (tests/planning/test_memory_fit.py)."""
    argv = ["plan", "--model", "tiny", "--nodes", "5", "--fault-tolerance", "1", "--global-batch", "8",
            "--microbatch", "1", "--device", "cpu", "--device-memory-gib", "0.034", "--shard-optimizer", "off"]
    code, out, err = run([*argv, "--json"], capsys)
    assert code == 0, err
    memory = json.loads(out)["memory"]
    assert memory["largest_worker_bytes"] <= memory["device_memory_bytes"] and memory["fits"], memory
    assert memory["margin_bytes"] > 0, memory
    code, out, err = run(argv, capsys)
    assert f"memory: planned with {memory['margin_bytes'] / 2**20:.2f} MiB held back on every worker" in out
    assert "WARNING" not in out


@pytest.mark.timeout(60)
def test_a_plan_that_no_margin_fits_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    """tiny on 7 nodes at 0.022 GiB, sharded, f = 0: the first plan's uneven split is over the
    device, and no plan with the excess held back exists: the first is printed with a warning."""
    argv = ["plan", "--model", "tiny", "--nodes", "7", "--fault-tolerance", "0", "--global-batch", "16",
            "--microbatch", "1", "--device", "cpu", "--device-memory-gib", "0.022", "--shard-optimizer", "on"]
    code, out, err = run([*argv, "--json"], capsys)
    assert code == 0, err
    memory = json.loads(out)["memory"]
    assert memory["largest_worker_bytes"] > memory["device_memory_bytes"] and not memory["fits"], memory
    assert memory["margin_bytes"] == 0, memory
    code, out, err = run(argv, capsys)
    assert "memory: WARNING: the largest worker exceeds the device by the memory model" in out
