"""The leader's planning at cluster scale: templates and first plan (what a leader computes when it
starts), then one re-plan after a node is lost, for N nodes x 8 GPUs of a GPT-3 6.7B-shaped model
(f = 1, one microbatch of 1 sequence per GPU).

The baseline, in the same run, is the planner's memory figures (`planner_figures`) computed by
asking every holder of every even split, as the planner did before it asked one holder of each
kind: both must give the same figures; the ratio is baseline / today. The baseline runs only up
to --baseline-max-nodes (it grows as N^2 holders).

    .venv/bin/python bench/planning_scale.py [--nodes 64 256 1024 2048] [--baseline-max-nodes 256] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.planning.cluster import ClusterSpec, cluster_templates, initial_plan  # noqa: E402
from elastic.planning.footprint import GradShare  # noqa: E402
from elastic.planning.planner_figures import PlannerFigures, holder_figures, planner_figures  # noqa: E402
from templates.replanning import replan  # noqa: E402

MODEL = "gpt3-6.7b"
GPUS_PER_NODE = 8


def every_holder(*, global_microbatches: int, max_pipelines: int) -> PlannerFigures:
    """The baseline: `planner_figures` by asking every holder of every even split."""
    grad, worker = 0.0, 0
    for p in range(1, min(max_pipelines, global_microbatches) + 1):
        split = [global_microbatches // p + (1 if i < global_microbatches % p else 0) for i in range(p)]
        for me in range(p):
            one = holder_figures(GradShare.of_split(split, me=me, partial_replay=True))
            grad, worker = max(grad, one.grad_bytes_per_param), max(worker, one.worker_bytes)
    return PlannerFigures(grad_bytes_per_param=grad, worker_bytes=worker)


def _timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def measure(nodes: int, *, baseline: bool) -> dict[str, Any]:
    spec = ClusterSpec(model=MODEL, nodes=nodes, gpus_per_node=GPUS_PER_NODE, fault_tolerance=1,
                       global_batch=nodes * GPUS_PER_NODE, microbatch=1, device_memory_gib=80)
    tset, templates_s = _timed(lambda: cluster_templates(spec))
    plan, initial_s = _timed(lambda: initial_plan(spec, tset))
    lost = plan.pipelines[0].stages[0].node
    again, replan_s = _timed(lambda: replan(tset, plan, [n for n in range(nodes) if n != lost]))
    row: dict[str, Any] = {"nodes": nodes, "gpus": nodes * GPUS_PER_NODE, "templates_s": templates_s,
                           "initial_plan_s": initial_s, "replan_s": replan_s,
                           "pipelines": len(plan.pipelines), "replan_strategy": again.strategy}
    mbs = spec.global_microbatches
    today, today_s = _timed(lambda: planner_figures(global_microbatches=mbs, max_pipelines=nodes))
    row["figures_s"] = today_s
    if baseline:
        before, before_s = _timed(lambda: every_holder(global_microbatches=mbs, max_pipelines=nodes))
        if before != today:
            raise SystemExit(f"{nodes} nodes: the figures differ: {before} (every holder) vs {today}")
        row["figures_every_holder_s"] = before_s
        row["ratio"] = before_s / today_s
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[64, 256, 1024, 2048])
    parser.add_argument("--baseline-max-nodes", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    rows = [measure(n, baseline=n <= args.baseline_max_nodes) for n in args.nodes]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{MODEL}, {GPUS_PER_NODE} GPUs per node, f = 1, global batch = GPUs (microbatch 1)")
    print("| nodes | GPUs | templates | first plan | re-plan after a loss | memory figures | every holder | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        base = (f"{r['figures_every_holder_s']:.2f} s | {r['ratio']:.0f}x" if "ratio" in r else "not run | -")
        print(f"| {r['nodes']} | {r['gpus']} | {r['templates_s']:.2f} s | {r['initial_plan_s']:.2f} s | "
              f"{r['replan_s']:.3f} s | {r['figures_s']:.2f} s | {base} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
