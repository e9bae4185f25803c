"""A torch.profiler trace of the engine's steps on one worker (bench/gpu_check.py's `--profile-trace`).

    PYTHONPATH=. python -m bench.engine_profile --model gpt2-124m --device cuda --trace-dir DIR --out profile.json

The engine's own step code in this process: a `Trainer` (elastic/engine/trainer.py) joins a
one-worker job as `elastic run --static --nodes 1` would run it (the same JobSpec defaults, the
same one-stage plan, its process groups on a TCPStore hosted here, as the launcher's), runs
`--warmup` steps, then 3 steps under the profiler (bench/trace_summary.py): top kernels, the
GPU's idle time inside the steps, the gzipped trace. Also reports this process's peak memory, a
cross-check of what the hook (bench/hooks/sitecustomize.py) reads in `elastic run`'s worker.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic.engine.optim import OptimConfig
from elastic.engine.trainer import Trainer
from elastic.records.job import JobSpec
from templates.plan import Plan

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.plain_loop import PROFILED_STEPS, peak_memory  # noqa: E402
from bench.trace_summary import profile_steps  # noqa: E402


def profile_engine(spec: JobSpec, *, warmup: int, trace_dir: Path) -> dict[str, Any]:
    """Warm-up steps, then PROFILED_STEPS steps of `spec`'s one worker under the profiler."""
    torch.set_num_threads(spec.threads_per_worker)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=spec.collective_timeout_s))
    trainer = Trainer(spec, node=spec.plan.nodes[0], local_rank=0)
    trainer.start(plan=spec.plan, generation=spec.generation, store=store, abort=None, fetch=None, step=0)
    losses = [trainer.commit(trainer.prepare_step()).loss for _ in range(warmup)]

    def step(_: int) -> None:
        losses.append(trainer.commit(trainer.prepare_step()).loss)

    summary = profile_steps(step, PROFILED_STEPS, trace_dir / "engine_trace.json.gz")
    trainer.close()
    return {**summary, "losses": losses, "peak_memory": peak_memory(trainer.device)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.engine_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu")
    parser.add_argument("--plan", type=Path, required=True, help="the one-worker plan JSON (bench/gpu_check.py's)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the profiled ones")
    parser.add_argument("--trace-dir", type=Path, required=True, help="the trace goes here")
    parser.add_argument("--run-dir", type=Path, required=True, help="the job's run directory (its logs)")
    parser.add_argument("--out", required=True, help="write the result JSON here")
    args = parser.parse_args(argv)
    plan = Plan.from_json(args.plan.read_text())
    args.run_dir.mkdir(parents=True, exist_ok=True)
    spec = JobSpec(model=args.model, plan=plan, steps=args.warmup + PROFILED_STEPS, run_dir=str(args.run_dir),
                   device=args.device, optim=OptimConfig())
    Path(args.out).write_text(json.dumps(profile_engine(spec, warmup=args.warmup, trace_dir=args.trace_dir),
                                         indent=1))
    return 0


if __name__ == "__main__":
    code = main()
    # Skip interpreter teardown, as the engine's elastic worker does (elastic/roles/elastic_worker.py):
    # the generation's process groups are never destroyed, and their destructors may hang or abort.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
