"""What recomputation costs in step time, against `none` in the same run (issue 54).

    python -m bench.recompute_cost                         # small, one node, 5 rounds
    python -m bench.recompute_cost --model tiny --steps 6 --rounds 2 --json out.json

Each round runs `elastic run --static --nodes 1 --recompute MODE` once per mode (none,
selective, full), the order rotated every round so that no mode always runs first (the
machine's state drifts); each run's figure is its summary's `steady_step_s` (the median step
time without the first step). Reported: the median over rounds per mode and its ratio to `none`.
Run it on a quiet machine: nothing else may compete for the cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from elastic.model.config import RECOMPUTE_MODES


def one_run(args: argparse.Namespace, mode: str, work: Path) -> float:
    summary = work / f"{mode}.json"
    cmd = [sys.executable, "-m", "elastic.cli", "run", "--static", "--nodes", "1", "--model", args.model,
           "--global-batch", str(args.global_batch), "--microbatch", str(args.microbatch), "--steps", str(args.steps),
           "--device", "cpu", "--recompute", mode, "--run-dir", str(work / mode),
           "--summary", str(summary), *args.extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return float(json.loads(summary.read_text())["steady_step_s"])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    samples: dict[str, list[float]] = {m: [] for m in RECOMPUTE_MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = RECOMPUTE_MODES[r % 3:] + RECOMPUTE_MODES[:r % 3]
            for mode in order:
                samples[mode].append(one_run(args, mode, Path(tmp) / f"round{r}"))
                print(f"round {r + 1}/{args.rounds} {mode}: {samples[mode][-1] * 1000:.0f} ms a step", flush=True)
    median = {m: statistics.median(s) for m, s in samples.items()}
    return {"model": args.model, "global_batch": args.global_batch, "microbatch": args.microbatch,
            "steps": args.steps, "rounds": args.rounds, "samples_s": samples, "median_s": median,
            "ratio_to_none": {m: median[m] / median["none"] for m in median}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--microbatch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path)
    parser.add_argument("extra", nargs="*", help="more `elastic run` flags (after --), e.g. -- --n-layer 4")
    args = parser.parse_args()
    result = measure(args)
    print("| recompute | median step (ms) | vs none |\n| --- | --- | --- |")
    for mode in RECOMPUTE_MODES:
        print(f"| {mode} | {result['median_s'][mode] * 1000:.0f} | {result['ratio_to_none'][mode]:.3f}x |")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
