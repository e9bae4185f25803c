"""Interleaved 1F1B against plain 1F1B on one 4-node pipeline (issue 53).

    .venv/bin/python bench/schedules.py --rounds 5

Each run is `elastic run` (its own etcd, f = 0, no checkpoints) of one 4-node pipeline at m = 8
microbatches, with `--virtual-stages 1` or `2`; the two alternate within each round (the order
flips every round), so a slow spell of the machine lands on both. The model (tiny reshaped: 16
blocks of d_model 384, 128 tokens, 18 planning layers) is sized so that one stage's forward and
backward of a microbatch takes 20 ms or more on one core (about 220 ms at half a core), and so
that its stages are even at both v: 4 blocks a stage at v = 1 (the embedding and the head ride
with the first and the last), 2 a virtual stage at v = 2. With 6 blocks the middle stages held 2
blocks and the outer ones 1, and the slowest stage, not the bubble, set both steps; with 8 (2 a
stage, `--n-layer 8 --device-memory-gib 0.2`) each of v = 2's twice as many transfers costs as
much as at 16 against half the computation, and the gain measured 1.06-1.11x (bench/README.md).
`--node-cpus` caps each node at a share of a core (a cgroup quota, needs root), so that a stage
that waits really idles, as a device would, instead of lending its core to the others.

Figures: each run's step time is the median of its steps' commit intervals after `--warmup`
steps; per side the median over rounds; the speedup is v = 1's over v = 2's (and, paired, the
median over rounds of each round's ratio). The prediction is
the planner's: `elastic plan --json` with the same flags, each plan's estimated iteration time
(templates/cost.py `pipeline_time`), its ratio against the measured one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ELASTIC = [sys.executable, "-m", "elastic.cli"]


def job_flags(args: argparse.Namespace, v: int) -> list[str]:
    """The flags the run and the plan share."""
    return ["--model", "tiny", "--n-layer", str(args.n_layer), "--d-model", str(args.d_model), "--seq-len",
            str(args.seq_len), "--nodes", "4", "--global-batch", str(args.microbatches), "--microbatch", "1",
            "--device", "cpu", "--device-memory-gib", str(args.device_memory_gib), "--device-tflops",
            str(args.device_tflops), "--recompute", "none", "--virtual-stages", str(v)]


def predicted(args: argparse.Namespace, v: int) -> tuple[float, list[int]]:
    """The planner's iteration time for `v`, and its pipelines' v (a forced v the memory cannot
    hold stays 1)."""
    out = subprocess.run([*ELASTIC, "plan", *job_flags(args, v), "--json"], cwd=REPO, capture_output=True, text=True,
                         check=True)
    plan = json.loads(out.stdout)["plan"]
    return float(plan["iteration_time"]), [int(p["virtual_stages"]) for p in plan["pipelines"]]


def run(args: argparse.Namespace, v: int, run_dir: Path) -> dict[str, float]:
    """One run: its median step time after the warm-up steps and its final loss."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [*ELASTIC, "run", *job_flags(args, v), "--steps", str(args.steps), "--run-dir", str(run_dir),
           "--checkpoint-every", "0", "--summary", str(run_dir / "summary.json")]
    if args.node_cpus > 0:
        cmd += ["--node-cpus", str(args.node_cpus)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.run_timeout)
    if proc.returncode != 0:
        raise SystemExit(f"v={v}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    times = summary["step_committed_at"][args.warmup:]
    steps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"step_s": statistics.median(steps), "loss": float(summary["losses"][-1])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of each run's median")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--n-layer", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--device-memory-gib", type=float, default=0.4,
                        help="the budget at which the planner lays one 4-node pipeline (default 0.4; 0.2 for "
                             "--n-layer 8)")
    parser.add_argument("--device-tflops", type=float, default=0.02,
                        help="the nominal speed the planner times stages at: about a core's share here")
    parser.add_argument("--node-cpus", type=float, default=0.5,
                        help="each node's cap in cores, a cgroup quota that needs root (default 0.5: 4 nodes take "
                             "the 2 cores of the development machine; 0: no cap, the nodes share the cores)")
    parser.add_argument("--run-timeout", type=float, default=600)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    plans = {v: predicted(args, v) for v in (1, 2)}
    for v, (_, vs) in plans.items():
        if vs != [v]:
            raise SystemExit(f"--virtual-stages {v} plans pipelines with v = {vs}, not one 4-node pipeline at v = {v}: "
                             "change --device-memory-gib")
    samples: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for v in ((1, 2) if r % 2 == 0 else (2, 1)):
                got = run(args, v, Path(tmp) / f"v{v}-r{r}")
                samples[v].append(got)
                print(f"round {r}: v={v} step {got['step_s'] * 1000:.1f} ms, final loss {got['loss']:.4f}", flush=True)
    step = {v: statistics.median(s["step_s"] for s in samples[v]) for v in samples}
    measured = step[1] / step[2]
    paired = statistics.median(a["step_s"] / b["step_s"] for a, b in zip(samples[1], samples[2], strict=True))
    model = plans[1][0] / plans[2][0]
    figures = {"step_s": step, "speedup": measured, "paired_speedup": paired, "predicted_speedup": model,
               "prediction_error": model / measured - 1, "samples": samples, "args": vars(args) | {"json": None}}
    print(f"v=1 {step[1] * 1000:.1f} ms/step, v=2 {step[2] * 1000:.1f} ms/step: speedup {measured:.3f}x "
          f"(median of the rounds' ratios {paired:.3f}x; planner predicts {model:.3f}x, "
          f"{100 * (model / measured - 1):+.1f} %)")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
