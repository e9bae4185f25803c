"""What bench/gpu_check.sh's report must say of a run on the CPU (`check_cpu_report`: the session
rehearsal, tests/bench/test_gpu_session.py, runs the script and applies it, so that the GPU
check cannot rot where no GPU runs it), and its trace and peak-memory readers against hand-made
inputs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench.gpu_check_phases import read_worker_peak
from bench.trace_summary import summarize

REPO = Path(__file__).resolve().parents[2]
RUNS = ("plain", "engine_static", "engine_control_plane")


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def check_cpu_report(report: dict[str, Any], steps: int) -> None:
    """What bench/gpu_check.sh's JSON says of a run on the CPU (tiny, `steps` steps, with a profile;
    tests/bench/test_gpu_session.py rehearses it): every run committed its steps, the engine's
    first loss is the plain loop's (the same model on the same samples), the figures are positive
    and finite, the worker's peak memory came through the hook, the profile has its trace; speed
    and memory targets are reported but not enforced on the CPU."""
    assert report["schema"] == "gpu_check/1" and report["passed"] is True
    assert report["targets_enforced"] is False and "not enforced" in report["targets_note"]
    for name in RUNS:
        run, fig = report["runs"][name], report["figures"][name]
        assert run["ok"] and run["steps_committed"] == steps and len(run["losses"]) == steps, name
        assert len(run["step_committed_at"]) == steps, name
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
