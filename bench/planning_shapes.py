"""The planner on published model shapes, GPT-3 beside the Llama family (issue 58): for each
(model, nodes x GPUs) the plan `elastic plan --json` lays out (its pipelines, their stages, the
step time it predicts) and the largest worker memory of that plan, as `elastic plan` reports it
(`elastic.planning.memory.plan_memory`: bf16 autocast on CUDA, the schedule's in-flight
microbatches, sequence parallelism at TP > 1, the stage's recomputation, partial replay's copy of
the sums). Predictions of the cost model on a nominal device, not measurements.

    PYTHONPATH=. .venv/bin/python bench/planning_shapes.py                 # the table of bench/README.md
    PYTHONPATH=. .venv/bin/python bench/planning_shapes.py --case llama3-8b:16 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time
from pathlib import Path
from typing import Any

from elastic.cli.main import main as elastic_main
from elastic.model.config import get_preset

CASES = ("gpt3-6.7b:16", "llama3-8b:16", "gpt3-6.7b:64", "llama3-70b:64")
GIB = 1024**3


def plan_json(model: str, nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    """`elastic plan --json` for the case."""
    out = io.StringIO()
    argv = ["plan", "--model", model, "--nodes", str(nodes), "--gpus-per-node", str(args.gpus_per_node),
            "--fault-tolerance", "1", "--global-batch", str(args.global_batch), "--microbatch", "1", "--device", "cuda",
            "--device-memory-gib", str(args.memory_gib), "--device-tflops", str(args.tflops), "--json"]
    with contextlib.redirect_stdout(out):
        code = elastic_main(argv)
    if code != 0:
        raise SystemExit(f"elastic {' '.join(argv)}: exit {code}")
    return dict(json.loads(out.getvalue()))


def largest_worker(model: str, out: dict[str, Any]) -> tuple[float, str]:
    """(GiB, where) of the plan's largest worker: `elastic plan`'s own `memory` figure."""
    m = out["memory"]
    return m["largest_worker_bytes"] / GIB, f"pipeline {m['pipeline']} stage {m['stage']} (node {m['node']})"


def run_case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    model, nodes = case.split(":")
    start = time.perf_counter()
    out = plan_json(model, int(nodes), args)
    planned = time.perf_counter() - start
    plan = out["plan"]
    gib, where = largest_worker(model, out)
    stages = sorted({len(p["stages"]) for p in plan["pipelines"]})
    return {"model": model, "nodes": int(nodes), "params_b": get_preset(model).num_params() / 1e9,
            "pipelines": len(plan["pipelines"]), "stages": stages, "iteration_s": plan["iteration_time"],
            "largest_worker_gib": gib, "largest_worker": where, "planned_s": planned}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", help="MODEL:NODES (default: the four of bench/README.md)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--memory-gib", type=float, default=80.0)
    parser.add_argument("--tflops", type=float, default=989.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [run_case(case, args) for case in (args.case or CASES)]
    print(f"{'model':12s} {'params':>7s} {'cluster':>8s} {'pipelines':>9s} {'stages':>8s} {'step s':>8s} "
          f"{'worker GiB':>10s}  largest worker")
    for r in rows:
        print(f"{r['model']:12s} {r['params_b']:6.2f}B {r['nodes']:>4d} x {args.gpus_per_node} {r['pipelines']:>9d} "
              f"{'/'.join(map(str, r['stages'])):>8s} {r['iteration_s']:8.2f} {r['largest_worker_gib']:10.1f}  "
              f"{r['largest_worker']}")
    if args.json is not None:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
