"""bench/gpu_check.sh on the CPU (so that the GPU check cannot rot where no GPU runs it), and its
trace and peak-memory readers against hand-made inputs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_check_phases import read_worker_peak
from bench.trace_summary import summarize

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
RUNS = ("plain", "engine_static", "engine_control_plane")


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_gpu_check_runs_on_cpu(tmp_path: Path) -> None:
    """The whole script on the tiny model: every run commits its steps, the engine's first loss is
    the plain loop's (the same model on the same samples), the figures are positive and finite,
    the worker's peak memory came through the hook, the profile has its trace; speed and memory
    targets are reported but not enforced on the CPU."""
    out = tmp_path / "result.json"
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), "--device", "cpu", "--model", "tiny", "--steps", str(STEPS),
         "--run-dir", str(tmp_path / "run"), "--json", str(out), "--profile-trace", str(tmp_path / "trace")],
        capture_output=True, text=True, timeout=140, env=dict(os.environ, PYTHON=sys.executable),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["schema"] == "gpu_check/1" and report["passed"] is True
    assert report["targets_enforced"] is False and "not enforced" in report["targets_note"]
    for name in RUNS:
        run, fig = report["runs"][name], report["figures"][name]
        assert run["ok"] and run["steps_committed"] == STEPS and len(run["losses"]) == STEPS, name
        assert len(run["step_committed_at"]) == STEPS, name
        for key in ("tokens_per_s", "ratio_to_plain", "mfu", "step_s_median", "peak_memory_bytes"):
            assert _positive(fig[key]), (name, key, fig[key])
    assert report["figures"]["plain"]["ratio_to_plain"] == 1.0
    for name in RUNS[1:]:
        assert report["figures"][name]["first_loss_rel_diff"] <= 1e-5, name
        peak = report["runs"][name]["peak_memory"]
        assert peak["workers"] == 1 and peak["measure"] == "peak RSS (cpu)", peak
    assert _positive(report["peak_flops"]["flops"]) and _positive(report["flops_per_token"])
    assert report["estimate"]["total_bytes"] is None or _positive(report["estimate"]["total_bytes"])
    by_name = {c["name"]: c for c in report["checks"]}
    speed = by_name["engine --static tokens/s vs plain"]
    assert speed["enforced"] is False and _positive(speed["value"])
    assert all(c["met"] for c in report["checks"] if c["enforced"])
    profile = report["runs"]["engine_profile"]
    assert profile["ok"] and profile["steps"] == 3 and profile["window_ms"] > 0 and profile["top_host_ops"]
    assert profile["gpu_idle_ms"] is None and Path(profile["trace"]).is_file()
    assert set(report["phase_wall_s"]) == {*RUNS, "engine_profile"}
    assert "engine --static" in proc.stdout and "PASSED" in proc.stdout


def test_trace_summary_counts_gpu_idle_inside_the_steps() -> None:
    """Two 100 us steps; kernels busy 30 + 20 us inside them (one overlapping another), one
    kernel outside every step: 150 us idle of 200, top kernel by total time first."""
    def ev(cat: str, name: str, ts: float, dur: float) -> dict[str, object]:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [
        ev("user_annotation", "bench_step_0", 0, 100), ev("user_annotation", "bench_step_1", 200, 100),
        ev("kernel", "gemm", 10, 30), ev("kernel", "gemm", 20, 10), ev("gpu_memcpy", "copy", 250, 20),
        ev("kernel", "softmax", 500, 50), ev("cpu_op", "aten::mm", 0, 300),
    ]
    s = summarize(events)
    assert s["window_ms"] == pytest.approx(0.2) and s["gpu_busy_ms"] == pytest.approx(0.05)
    assert s["gpu_idle_ms"] == pytest.approx(0.15) and s["gpu_idle_share"] == pytest.approx(0.75)
    assert [k["name"] for k in s["top_kernels"]] == ["softmax", "gemm"] and s["kernels_launched"] == 3


def test_worker_peak_is_read_at_the_last_commit(tmp_path: Path) -> None:
    """The hook's last report before the last commit, not the final-state export after it."""
    rows = [{"t": 1.0, "allocated": 10, "reserved": 20, "rss": 5}, {"t": 2.0, "allocated": 40, "reserved": 50, "rss": 6},
            {"t": 4.0, "allocated": 90, "reserved": 99, "rss": 7}]
    (tmp_path / "peak-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    peak = read_worker_peak(tmp_path, 3.0, device="cuda")
    assert peak["bytes"] == 40 and peak["at_end"]["allocated"] == 90 and peak["read_s_before_last_commit"] == 1.0
    assert read_worker_peak(tmp_path / "none", 3.0, device="cuda")["bytes"] is None
