"""A torch.profiler trace of a few training steps, and what it says: the top kernels and how
long the GPU sat idle while the steps ran (bench/gpu_check.py's `--profile-trace`).

Each profiled step runs inside a `bench_step_<i>` annotation. The steps' window is the union of
those annotations on the host's timeline (each step ends with a host sync, so its GPU work ends
inside it); the GPU is busy where a kernel, memcpy or memset runs, and idle for the rest of the
window. On a machine without a GPU the trace has no kernels: the top entries are then the host
ops by self time and the idle time is None.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

STEP_PREFIX = "bench_step_"
"""Name prefix of the annotation around each profiled step."""
GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
"""Chrome-trace categories of work on the device."""
TOP = 10
"""How many kernels (or host ops) the summary lists."""


def profile_steps(step: Callable[[int], object], count: int, trace_path: Path) -> dict[str, Any]:
    """Run `step(0)` .. `step(count - 1)` under torch.profiler (every activity this torch
    supports), write the trace gzipped to `trace_path` (open it in Perfetto or chrome://tracing)
    and return its summary (`summarize`)."""
    with torch.profiler.profile(activities=list(torch.profiler.supported_activities())) as prof:
        for i in range(count):
            with torch.profiler.record_function(f"{STEP_PREFIX}{i}"):
                step(i)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    raw = trace_path.with_name(trace_path.name.removesuffix(".gz") + ".tmp")
    prof.export_chrome_trace(str(raw))
    events = json.loads(raw.read_text())["traceEvents"]
    with gzip.open(trace_path, "wb") as f:
        f.write(raw.read_bytes())
    raw.unlink()
    summary = summarize(events)
    if not summary["top_kernels"]:  # no device work recorded: the host's ops instead
        summary["top_host_ops"] = _top_host_ops(prof.key_averages())
    summary["trace"] = str(trace_path)
    summary["steps"] = count
    return summary


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Top kernels by total time, and the GPU's busy and idle time inside the steps' window."""
    steps = [_span(e) for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(STEP_PREFIX)
             and e.get("cat") == "user_annotation"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    window_us = _length(_union(steps))
    busy_us = _length(_intersect(_union(_span(e) for e in gpu), _union(steps)))
    kernels: dict[str, list[float]] = {}
    for e in gpu:
        if e["cat"] == "kernel":
            kernels.setdefault(str(e["name"]), []).append(float(e.get("dur", 0.0)))
    kernel_us = sum(sum(d) for d in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:TOP]
    return {
        "window_ms": window_us / 1e3,
        "gpu_busy_ms": busy_us / 1e3 if gpu else None,
        "gpu_idle_ms": (window_us - busy_us) / 1e3 if gpu else None,
        "gpu_idle_share": (window_us - busy_us) / window_us if gpu and window_us > 0 else None,
        "kernels_launched": sum(len(d) for d in kernels.values()),
        "top_kernels": [
            {"name": name, "calls": len(d), "total_ms": sum(d) / 1e3, "share_of_kernel_time": sum(d) / kernel_us}
            for name, d in top
        ],
    }


def _top_host_ops(averages: Any) -> list[dict[str, Any]]:
    rows = sorted((a for a in averages if not a.key.startswith(STEP_PREFIX)), key=lambda a: -a.self_cpu_time_total)[:TOP]
    return [{"name": a.key, "calls": a.count, "self_ms": a.self_cpu_time_total / 1e3} for a in rows]


def _span(event: dict[str, Any]) -> tuple[float, float]:
    start = float(event["ts"])
    return start, start + float(event.get("dur", 0.0))


def _union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering `spans`."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intersection of two sorted disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)
