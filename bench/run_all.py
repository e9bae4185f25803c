"""Every benchmark of issue 8 in one command: one table on stdout, one JSON file.

    .venv/bin/python bench/run_all.py                  # full: tiny, small, gpt2-124m, 3 repeats (hours on 2 CPU cores)
    .venv/bin/python bench/run_all.py --quick          # smoke version: tiny only, shorter runs, 1 repeat
    .venv/bin/python bench/run_all.py --only recovery overhead --presets tiny small --repeats 5

Sections: recovery (bench/recovery_compare.py: this runtime vs torchrun restart vs torchft),
overhead (bench/overhead.py: vs DDP and torch.distributed.pipelining), effective (bench/
effective_time.py: a node lost every T seconds, then rejoining, vs torchrun restart), planner (bench/planner_bench.py),
mfu (bench/mfu.py; reports "no GPU" where none is visible). Every figure is the median over
repeats with its spread; NOISY marks a spread above 10 % of the median (bench/stats.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import effective_time, overhead, recovery_compare  # noqa: E402
from bench.section import Section, exit_on_sigterm, series  # noqa: E402
from bench.stats import Figure  # noqa: E402

SECTIONS = ("recovery", "overhead", "effective", "planner", "mfu")
OVERHEAD_TURN_S = 2.0
"""The overhead section's sides take turns of this many seconds (bench/turns.py): on a shared
machine whose speed drifts, runs one after another measured rounds of one tree 0.8-1.3x apart."""


def _json_script(argv: list[str], timeout_s: float) -> dict[str, Any]:
    """Run a bench script that prints one JSON object as its last stdout output; return it."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=timeout_s, env=env, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"{argv[0]} exited with {out.returncode}: {out.stderr.strip()[-500:]}")
    text = out.stdout.strip()
    return dict(json.loads(text[text.index("{") :]))


def planner(repeats: int, quick: bool) -> Section:
    section = Section(
        title="Planner: GPT-3 175B shape (98 layers), templates n <= 64, instantiations N in [64, 256]"
    )
    section.notes.append("baseline in the same run: the same exact search without its bottleneck window")
    started = time.time()
    figures: dict[str, Figure] = {}
    for _ in range(repeats):
        r = _json_script([str(REPO / "bench" / "planner_bench.py"), "--json"], timeout_s=1800)
        section.raw.append(r)
        series(figures, "planner: all templates", "s", r["template_seconds"])
        series(figures, "planner: baseline (no bottleneck window)", "s", r["baseline_seconds"])
        series(figures, "planner: ratio baseline / windowed", "x", r["speedup_vs_baseline"])
        series(figures, "planner: one instantiation (per N)", "ms", r["instantiate_ms_per_N"])
    section.figures = list(figures.values())
    section.wall_s = time.time() - started
    return section


def mfu(repeats: int, quick: bool) -> Section:
    import torch

    section = Section(title="Model FLOPs utilisation of one worker (bench/mfu.py)")
    started = time.time()
    if not torch.cuda.is_available():
        section.not_run.append("mfu: not run: no GPU on this machine (CPU only)")
        return section
    figures: dict[str, Figure] = {}
    for model in ("tiny",) if quick else ("gpt2-124m", "small", "tiny"):
        for _ in range(repeats):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                _json_script([str(REPO / "bench" / "mfu.py"), "--model", model, "--microbatch", "8", "--steps", "20",
                              "--json", f.name], timeout_s=1800)
                r = json.loads(Path(f.name).read_text())
            section.raw.append(r)
            series(figures, f"mfu {model}: tokens/s", "tok/s", r["tokens_per_s"])
            series(figures, f"mfu {model}: model FLOP/s / same-run matmul", "ratio", r["ratio_to_matmul"])
            if r["mfu_datasheet"] is not None:
                series(figures, f"mfu {model}: MFU vs datasheet peak", "%", 100 * r["mfu_datasheet"])
        section.notes.append(f"device {section.raw[-1]['device']}, {section.raw[-1]['precision']}")
    section.figures = list(figures.values())
    section.wall_s = time.time() - started
    return section


def header() -> list[str]:
    import torch

    load = os.getloadavg()
    return [
        f"bench/run_all.py  {time.strftime('%Y-%m-%d %H:%M:%S')}  {platform.node()}  {os.cpu_count()} CPUs  "
        f"torch {torch.__version__}  load average at start {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}",
        "figure: median [min .. max] n=runs ±half-range/median (NOISY above 10 %)",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke version: tiny only, short runs, 1 repeat")
    parser.add_argument(
        "--repeats", type=int, default=None, help="runs per figure (default 3; 1 with --quick)"
    )
    parser.add_argument("--presets", nargs="+", default=None, choices=list(recovery_compare.FULL),
                        help="recovery presets (default: all three; tiny with --quick)")
    parser.add_argument("--only", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--json", type=Path, default=None,
                        help="output file (default bench/results.json, bench/results-quick.json with --quick)")
    parser.add_argument(
        "--run-dir", type=Path, default=None, help="keep the runs' logs here (default: a temp dir)"
    )
    args = parser.parse_args()
    exit_on_sigterm()
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    presets = args.presets or (["tiny"] if args.quick else list(recovery_compare.FULL))
    out = args.json or REPO / "bench" / ("results-quick.json" if args.quick else "results.json")
    root = args.run_dir or Path(tempfile.mkdtemp(prefix="bench-run-all-"))
    print(f"runs under {root}", file=sys.stderr, flush=True)
    started = time.time()
    lines = header()
    sections: list[Section] = []
    for name in args.only:
        print(f"-- {name}", file=sys.stderr, flush=True)
        if name == "recovery":
            s = recovery_compare.measure(
                presets=presets, repeats=repeats, quick=args.quick, root=root / "recovery"
            )
        elif name == "overhead":
            s = overhead.measure(model="tiny", procs=2, global_batch=16, microbatch=4, steps=6 if args.quick else 12,
                                 repeats=repeats, root=root / "overhead", interleave_s=OVERHEAD_TURN_S)
        elif name == "effective":
            # a node lost every T s, back R s later, W s of training measured (effective_time.py)
            model, trace, window = (
                ("tiny", effective_time.Trace(every_s=20.0, rejoin_s=5.0), 60.0) if args.quick
                else ("small", effective_time.Trace(every_s=50.0, rejoin_s=15.0), 200.0)
            )
            s = effective_time.measure(model=model, trace=trace, window_s=window, repeats=repeats,
                                       root=root / "effective")
        elif name == "planner":
            s = planner(repeats, args.quick)
        else:
            s = mfu(repeats, args.quick)
        sections.append(s)
        print("\n".join(s.lines()), file=sys.stderr, flush=True)
    for s in sections:
        lines += s.lines()
    lines.append(
        f"total wall time {time.time() - started:.0f} s ({'quick' if args.quick else 'full'}, {repeats} repeats)"
    )
    print("\n".join(lines))
    out.write_text(json.dumps({"header": lines[:2], "quick": args.quick, "repeats": repeats,
                               "wall_s": time.time() - started, "sections": [s.to_dict() for s in sections]}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
