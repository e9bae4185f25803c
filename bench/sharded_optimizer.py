"""The sharded optimizer's step time against the unsharded one (issue 55).

    PYTHONPATH=. .venv/bin/python bench/sharded_optimizer.py --model tiny --steps 12 --rounds 5
    PYTHONPATH=. .venv/bin/python bench/sharded_optimizer.py --model tiny --pipelines 2 --fault-tolerance 0

Each run is the static launcher (no control plane) of P one-stage pipelines on P nodes (default
4 at f = 1: every layer has 4 holders, each owning half of its moments), m = 8 microbatches of 1, with
`shard_optimizer` off or on; the two alternate within each round, so a slow spell of the machine
lands on both. A run's figure is the median of its steps' times after the first two; per side the
median over rounds; the ratio is on's over off's. With sharding, a step sends each reduced
gradient element to its owners only (elastic/engine/shard_reduce.py), does half the AdamW work,
and gathers the parameters the others updated before its next forward (un-overlapped today).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from elastic.engine.optim import OptimConfig
from elastic.model.config import get_preset
from elastic.records.job import JobSpec
from elastic.roles.static_launcher import launch
from templates.plan import even_plan


def one_run(args: argparse.Namespace, mode: str, run_dir: Path) -> float:
    """The median step time of one run, in seconds."""
    plan = even_plan(num_layers=get_preset(args.model).num_layers, nodes=list(range(args.pipelines)),
                     num_pipelines=args.pipelines, global_microbatches=8, microbatch_size=1,
                     fault_tolerance=args.fault_tolerance)
    spec = JobSpec(model=args.model, plan=plan, steps=args.steps, run_dir=str(run_dir), device="cpu",
                   optim=OptimConfig(lr=1e-3, warmup_steps=2, eps=1e-6), shard_optimizer=mode)
    summary = launch(spec, quiet=True, timeout_s=1800)
    return statistics.median(summary.step_seconds[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pipelines", type=int, default=4, help="one-stage pipelines, one node each (P)")
    parser.add_argument("--fault-tolerance", type=int, default=1, help="f: slices are P // (f + 1)")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="bench-shard-") as tmp:
        for r in range(args.rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            for mode in order:
                times[mode].append(one_run(args, mode, Path(tmp) / f"{mode}{r}"))
                print(f"round {r} {mode}: {times[mode][-1] * 1e3:.1f} ms", flush=True)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"{args.model}, P = {args.pipelines}, f = {args.fault_tolerance}: off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms, on / off {on / off:.3f}")


if __name__ == "__main__":
    main()
