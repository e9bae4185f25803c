"""The sharded optimizer's step time against the unsharded one (issue 55).

    PYTHONPATH=. .venv/bin/python bench/sharded_optimizer.py --model tiny --steps 12 --rounds 5
    PYTHONPATH=. .venv/bin/python bench/sharded_optimizer.py --model tiny --node-cpus 0
    PYTHONPATH=. .venv/bin/python bench/sharded_optimizer.py --model tiny --pipelines 2 --fault-tolerance 0

Each run is P one-stage pipelines on P nodes (default 4 at f = 1: every layer has 4 holders,
each owning half of its moments), `--global-batch` sequences a step in microbatches of
`--microbatch` (default 16 in 4: `bench/engine_vs_ddp.py`'s shape, one microbatch a pipeline),
with `shard_optimizer` off or on; the two alternate within each round, so a slow spell of the
machine lands on both. With `--node-cpus X` (default 0.5, a cgroup quota that needs root) each
run is `elastic run --plan` with each node capped at X cores, standing for a device a node; with
0 it is the static launcher (no control plane) and the nodes share the cores. A run's figure is
the median of its steps' times after the first `--warmup` (under `elastic run`, the intervals
between the steps' commits, control plane included, as in bench/schedules.py; under the static
launcher, the steps' own times); per side the median over rounds; the
ratio is on's over off's (and the median of the rounds' own ratios). With sharding, a step sends
each reduced gradient element to its owners only (elastic/engine/shard_reduce.py), does half the
AdamW work, and gathers the parameters the others updated, each layer waited for right before its
first forward (elastic/engine/param_gather.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from elastic.engine.optim import OptimConfig
from elastic.model.config import get_preset
from elastic.records.job import JobSpec
from elastic.roles.static_launcher import launch
from templates.plan import Plan, even_plan

REPO = Path(__file__).resolve().parent.parent


def quota_run(args: argparse.Namespace, plan: Plan, mode: str, run_dir: Path) -> list[float]:
    """Step times of one `elastic run --plan` with each node at `--node-cpus` cores."""
    run_dir.mkdir(parents=True)
    (run_dir / "plan.json").write_text(plan.to_json())
    cmd = [sys.executable, "-m", "elastic.cli", "run", "--plan", str(run_dir / "plan.json"), "--model", args.model,
           "--steps", str(args.steps), "--device", "cpu", "--node-cpus", str(args.node_cpus), "--shard-optimizer",
           mode, "--straggler-policy", "off", "--checkpoint-every", "0", "--lr", "1e-3", "--warmup-steps", "2",
           "--run-dir", str(run_dir / "run"), "--summary", str(run_dir / "summary.json")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    times = json.loads((run_dir / "summary.json").read_text())["step_committed_at"]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def one_run(args: argparse.Namespace, mode: str, run_dir: Path) -> float:
    """The median step time of one run after the warm-up steps, in seconds."""
    plan = even_plan(num_layers=get_preset(args.model).num_layers, nodes=list(range(args.pipelines)),
                     num_pipelines=args.pipelines, global_microbatches=args.global_batch // args.microbatch,
                     microbatch_size=args.microbatch, fault_tolerance=args.fault_tolerance)
    if args.node_cpus > 0:
        return statistics.median(quota_run(args, plan, mode, run_dir)[args.warmup:])
    spec = JobSpec(model=args.model, plan=plan, steps=args.steps, run_dir=str(run_dir), device="cpu",
                   optim=OptimConfig(lr=1e-3, warmup_steps=2, eps=1e-6), shard_optimizer=mode)
    summary = launch(spec, quiet=True, timeout_s=1800)
    return statistics.median(summary.step_seconds[args.warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of each run's median")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pipelines", type=int, default=4, help="one-stage pipelines, one node each (P)")
    parser.add_argument("--fault-tolerance", type=int, default=1, help="f: slices are P // (f + 1)")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences a step, over all pipelines")
    parser.add_argument("--microbatch", type=int, default=4, help="sequences a microbatch")
    parser.add_argument("--node-cpus", type=float, default=0.5,
                        help="each node's cap in cores, a cgroup quota that needs root (0: the static launcher, "
                             "the nodes sharing the cores)")
    args = parser.parse_args()
    if args.global_batch % (args.microbatch * args.pipelines):
        parser.error(f"--global-batch {args.global_batch} is not a multiple of --microbatch x --pipelines "
                     f"({args.microbatch} x {args.pipelines})")
    times: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="bench-shard-") as tmp:
        for r in range(args.rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            for mode in order:
                times[mode].append(one_run(args, mode, Path(tmp) / f"{mode}{r}"))
                print(f"round {r} {mode}: {times[mode][-1] * 1e3:.1f} ms", flush=True)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    paired = statistics.median(a / b for a, b in zip(times["on"], times["off"], strict=True))
    print(f"{args.model}, P = {args.pipelines}, f = {args.fault_tolerance}, global batch {args.global_batch} in "
          f"microbatches of {args.microbatch}, node cpus {args.node_cpus or 'shared'}: off {off * 1e3:.1f} ms, "
          f"on {on * 1e3:.1f} ms, on / off {on / off:.3f} (median of the rounds' own ratios {paired:.3f})")


if __name__ == "__main__":
    main()
