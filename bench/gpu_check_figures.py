"""bench/gpu_check.py's figures from its phases' outputs: tokens/s, ratios, MFU, memory against
the planner's estimate, the checks against the targets, and the printed table."""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

from bench.gpu_check_phases import Settings
from bench.mfu import datasheet_peak, flops_per_token

TARGETS = {"engine_static": 0.95, "engine_control_plane": 0.93}
"""Least tokens/s of each engine run as a ratio of the plain loop's."""
MEMORY_TOLERANCE = 0.15
"""Largest relative gap between an engine run's peak memory and the planner's estimate."""
FIRST_LOSS_RTOL = {"cpu": 1e-5, "cuda": 2e-2}
"""Relative gap allowed between the first step's loss of an engine run and of the plain loop:
fp32 on the CPU computes the same sums; bf16 kernels may differ between processes on a GPU."""
RUNS = {"plain": "plain loop", "engine_static": "engine --static", "engine_control_plane": "engine control plane"}
"""The measured runs, and their names in the table."""


def planner_estimate(s: Settings) -> dict[str, Any]:
    """The planner's memory estimate of the engine's one worker (`total_bytes` None, with a note,
    when elastic.planning.memory is not there or refuses the call). `compared_bytes` is what a
    measured peak is held against: the total less the estimate's `reserve` (CUDA context and
    communicators), which `max_memory_allocated` does not see."""
    import inspect

    import torch

    from elastic.model.config import get_preset

    try:
        from elastic.planning.memory import worker_memory  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        return {"total_bytes": None, "note": f"no estimate: {exc}"}
    cfg = get_preset(s.model)
    dtype = torch.bfloat16 if s.device == "cuda" else torch.float32
    call = (f"worker_memory({s.model}, layers=(0, {cfg.num_layers}), microbatch_size={s.microbatch}, in_flight=1, "
            f"tp=1, holders=1, compute_dtype={dtype}, partial_replay=False, device_type={s.device!r})")
    # One stage: 1F1B holds one microbatch's activations at a time; one pipeline: no partial replay.
    extra = {}
    if "microbatches" in inspect.signature(worker_memory).parameters:  # the pipeline's microbatches a step
        extra["microbatches"] = s.global_batch // s.microbatch
        call = call[:-1] + f", microbatches={extra['microbatches']})"
    try:
        estimate = worker_memory(cfg, layers=(0, cfg.num_layers), microbatch_size=s.microbatch, in_flight=1, tp=1,
                                 holders=1, compute_dtype=dtype, partial_replay=False, device_type=s.device, **extra)
    except (TypeError, ValueError) as exc:
        return {"total_bytes": None, "note": f"no estimate: {call} raised {exc!r}", "call": call}
    parts = dataclasses.asdict(estimate) if dataclasses.is_dataclass(estimate) and not isinstance(estimate, type) else {}
    reserve = int(getattr(estimate, "reserve", 0))
    return {"total_bytes": int(estimate.total), "reserve_bytes": reserve, "compared_bytes": int(estimate.total) - reserve,
            "parts": parts, "call": call}


def _peak_flops(s: Settings, plain: dict[str, Any]) -> dict[str, Any]:
    name = (plain.get("device") or {}).get("name") or s.device
    if s.peak_tflops is not None:
        return {"flops": s.peak_tflops * 1e12, "source": "--peak-tflops"}
    sheet = datasheet_peak(name)
    if sheet is not None:
        return {"flops": sheet, "source": f"datasheet, dense bf16 ({name})"}
    if plain.get("matmul_flops"):
        return {"flops": plain["matmul_flops"],
                "source": f"measured {plain.get('matmul_dtype')} matmul in the plain phase ({name})"}
    return {"flops": None, "source": "none: the plain phase failed"}


def _steady(run: dict[str, Any], s: Settings, tokens_per_step: int) -> tuple[float | None, float | None]:
    """(tokens/s, median step seconds) over the steps after the warm-up, from the commit times."""
    at = run.get("step_committed_at") or []
    if not run.get("ok") or len(at) < s.warmup + 2:
        return None, None
    span = at[-1] - at[s.warmup - 1]
    gaps = [b - a for a, b in zip(at[s.warmup - 1 : -1], at[s.warmup :], strict=True)]
    return (tokens_per_step * (len(at) - s.warmup) / span if span > 0 else None), statistics.median(gaps)


def derive(s: Settings, runs: dict[str, Any], estimate: dict[str, Any]) -> dict[str, Any]:
    """The figures of each run, the device, the peak and the FLOPs per token."""
    from elastic.model.config import get_preset

    cfg = get_preset(s.model)
    per_token = flops_per_token(cfg)
    plain = runs.get("plain", {})
    peak = _peak_flops(s, plain)
    tokens_per_step = s.global_batch * cfg.seq_len
    figures: dict[str, dict[str, Any]] = {}
    base, _ = _steady(plain, s, tokens_per_step)
    for name in RUNS:
        run = runs.get(name, {})
        rate, step_s = _steady(run, s, tokens_per_step)
        memory = (run.get("peak_memory") or {}).get("bytes")
        figures[name] = {
            "ok": bool(run.get("ok")), "skipped": run.get("skipped"),
            "steps_committed": run.get("steps_committed"),
            "tokens_per_s": rate, "step_s_median": step_s,
            "ratio_to_plain": rate / base if rate and base else None,
            "mfu": rate * per_token / peak["flops"] if rate and peak["flops"] else None,
            "peak_memory_bytes": memory, "peak_memory_measure": (run.get("peak_memory") or {}).get("measure"),
            "memory_vs_estimate": memory / estimate["compared_bytes"] if memory and estimate.get("compared_bytes") else None,
            "first_loss_rel_diff": _first_loss_gap(run, plain) if name != "plain" else None,
        }
    return {"device": plain.get("device"), "precision": plain.get("precision"), "peak_flops": peak,
            "flops_per_token": per_token, "tokens_per_step": tokens_per_step, "figures": figures}


def _first_loss_gap(run: dict[str, Any], plain: dict[str, Any]) -> float | None:
    a, b = (run.get("losses") or [None])[0], (plain.get("losses") or [None])[0]
    return None if a is None or b is None else abs(a - b) / max(abs(b), 1e-12)


def _check(name: str, value: float | None, target: str, met: bool | None, *, enforced: bool,
           note: str = "") -> dict[str, Any]:
    return {"name": name, "value": value, "target": target, "met": met, "enforced": enforced, "note": note}


def checks(s: Settings, report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every check: `enforced` ones decide the exit status (speed and memory only on CUDA)."""
    on_gpu = s.device == "cuda"
    figures, runs = report["figures"], report["runs"]
    out = []
    for name, run in runs.items():
        if run.get("skipped"):
            out.append(_check(f"{name}: ran", None, "ran", None, enforced=False, note=run["skipped"]))
            continue
        note = str(run.get("error") or run.get("exit_warning") or "").split("\n")[0]
        if name == "engine_profile":
            out.append(_check(f"{name}: ran", run.get("steps"), "3 steps profiled", bool(run.get("ok")),
                              enforced=True, note=note))
            continue
        done = run.get("steps_committed")
        out.append(_check(f"{name}: ran and committed its {s.steps} steps", done, f"== {s.steps}",
                          bool(run.get("ok")) and done == s.steps, enforced=True, note=note))
    estimate = report["estimate"].get("total_bytes")
    for name, least in TARGETS.items():
        fig = figures[name]
        if fig["skipped"]:
            continue
        ratio = fig["ratio_to_plain"]
        out.append(_check(f"{RUNS[name]} tokens/s vs plain", ratio, f">= {least}",
                          None if ratio is None else ratio >= least, enforced=on_gpu))
        gap = fig["memory_vs_estimate"]
        out.append(_check(f"{RUNS[name]} peak memory vs estimate", gap, f"within {MEMORY_TOLERANCE:.0%}",
                          None if gap is None else abs(gap - 1.0) <= MEMORY_TOLERANCE, enforced=on_gpu,
                          note="" if estimate else report["estimate"].get("note", "no estimate")))
        diff, tol = fig["first_loss_rel_diff"], FIRST_LOSS_RTOL[s.device]
        out.append(_check(f"{RUNS[name]} first loss vs plain (relative gap)", diff, f"<= {tol:g}",
                          diff is not None and diff <= tol, enforced=True))
    for c in out:  # an enforced check with nothing measured fails
        if c["enforced"] and c["met"] is None:
            c["met"] = False
    return out


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value * scale, spec)


def print_table(report: dict[str, Any]) -> None:
    """The report as a readable table (every figure is in the JSON too)."""
    s, dev, peak = report["settings"], report.get("device") or {}, report["peak_flops"]
    print(f"\ngpu_check: {s['model']} on {dev.get('name', s['device'])} (torch {dev.get('torch')}, "
          f"CUDA {dev.get('cuda')}), {report.get('precision')}; global batch {s['global_batch']} = "
          f"{s['global_batch'] // s['microbatch']} x {s['microbatch']}, {report['tokens_per_step']} tokens/step, "
          f"{s['steps']} steps, tokens/s over the last {s['steps'] - s['warmup']}")
    print(f"  MFU peak: {_fmt(peak['flops'], '.1f', 1e-12)} TFLOP/s ({peak['source']}); model "
          f"{report['flops_per_token'] / 1e9:.3f} GFLOP/token")
    est = report["estimate"]
    print(f"  planner estimate: {_fmt(est.get('total_bytes'), '.3f', 2**-30)} GiB, of which "
          f"{_fmt(est.get('reserve_bytes'), '.3f', 2**-30)} GiB reserve (context, communicators): peaks are held against "
          f"{_fmt(est.get('compared_bytes'), '.3f', 2**-30)} GiB" + (f" ({est['note']})" if est.get("note") else ""))
    memory = "peak GiB" + (" (RSS)" if s["device"] == "cpu" else "")
    print(f"\n  {'run':22s} {'tokens/s':>11s} {'x plain':>8s} {'step ms':>9s} {'MFU':>7s} {memory:>15s} "
          f"{'x estimate':>10s} {'1st loss gap':>12s}")
    for name, label in RUNS.items():
        f = report["figures"][name]
        if f["skipped"] or not f["ok"]:
            print(f"  {label:22s} {f['skipped'] or 'FAILED (see checks)'}")
            continue
        print(f"  {label:22s} {_fmt(f['tokens_per_s'], ',.0f'):>11s} {_fmt(f['ratio_to_plain'], '.3f'):>8s} "
              f"{_fmt(f['step_s_median'], '.1f', 1e3):>9s} {_fmt(f['mfu'], '.2%'):>7s} "
              f"{_fmt(f['peak_memory_bytes'], '.3f', 2**-30):>15s} {_fmt(f['memory_vs_estimate'], '.3f'):>10s} "
              f"{_fmt(f['first_loss_rel_diff'], '.1e'):>12s}")
    _print_profiles(report["runs"])
    print(f"\n  checks ({report['targets_note']}):")
    for c in report["checks"]:
        mark = ("ok" if c["met"] else "FAIL") if c["enforced"] else "info"
        value = c["value"] if not isinstance(c["value"], float) else f"{c['value']:.4g}"
        print(f"    {mark:5s} {c['name']}: {value} (target {c['target']})" + (f"  [{c['note']}]" if c["note"] else ""))
    print("\n  phase wall times: " + ", ".join(f"{k} {v:.1f} s" for k, v in report["phase_wall_s"].items()))


def _print_profiles(runs: dict[str, Any]) -> None:
    for label, prof in (("engine", runs.get("engine_profile", {})), ("plain", runs.get("plain", {}).get("profile"))):
        if not prof or not (prof.get("top_kernels") or prof.get("top_host_ops")):
            continue
        idle = prof.get("gpu_idle_ms")
        print(f"\n  {label} profile ({prof['steps']} steps, {prof['window_ms']:.1f} ms, trace {prof['trace']}): "
              + (f"GPU idle {idle:.1f} ms ({prof['gpu_idle_share']:.1%}), {prof['kernels_launched']} kernels"
                 if idle is not None else "no GPU in the trace; host ops by self time"))
        for k in prof["top_kernels"] or prof.get("top_host_ops", []):
            ms = k.get("total_ms", k.get("self_ms", 0.0))
            print(f"    {ms:9.2f} ms {k['calls']:6d} x  {k['name'][:90]}")
