"""The planner's recomputation trade (issue 54): plans with `--recompute auto` against the best
plan without recomputation, for gpt3-6.7b on 64 nodes.

    python -m bench.recompute_planning                     # the table of bench/README.md
    python -m bench.recompute_planning --json out.json

For each cluster (devices per node, device type: CPU plans fp32 activations, CUDA bf16 ones and
a reserve; fault tolerance f), the planner runs twice on the same derived profile: forbidden to
recompute (`none`) and free to choose per stage (`auto`). Reported: the fewest nodes a pipeline
needs (n0), the plan's pipelines and predicted step time, and how many stages recompute what.
These are the planner's predictions (templates/cost.py), not measurements.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

from elastic.planning.cluster import ClusterSpec, cluster_templates, initial_plan
from templates.template_set import PlanningError

CLUSTERS = [  # (devices per node, device type, f)
    (1, "cpu", 1), (1, "cpu", 4), (1, "cuda", 1), (1, "cuda", 4), (8, "cpu", 1), (8, "cuda", 1),
]


def plan_row(*, gpus: int, device_type: str, f: int, recompute: str, model: str, nodes: int,
             microbatch: int, global_batch: int, memory_gib: float) -> dict[str, Any]:
    spec = ClusterSpec(model=model, nodes=nodes, gpus_per_node=gpus, fault_tolerance=f, global_batch=global_batch,
                       microbatch=microbatch, device_memory_gib=memory_gib, device_type=device_type,
                       recompute=recompute)
    row: dict[str, Any] = {"gpus_per_node": gpus, "device": device_type, "f": f, "recompute": recompute}
    try:
        tset = cluster_templates(spec)
        plan = initial_plan(spec, tset)
    except PlanningError as exc:
        return row | {"plan": None, "error": str(exc)}
    modes = collections.Counter(st.recompute for pipe in plan.pipelines for st in pipe.stages)
    return row | {"n0": tset.min_nodes, "pipelines": len(plan.pipelines), "step_s": plan.iteration_time,
                  "stages": dict(modes), "plan": plan.to_dict()}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| devices | device | f | recompute | n0 | pipelines | predicted step (s) | stages recomputing | auto vs none |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    none = {(r["gpus_per_node"], r["device"], r["f"]): r for r in rows if r["recompute"] == "none"}
    for r in rows:
        key = (r["gpus_per_node"], r["device"], r["f"])
        if r["plan"] is None:
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {r['recompute']} | - | no plan | - | - | |")
            continue
        recomputing = ", ".join(f"{n} {m}" for m, n in sorted(r["stages"].items()) if m != "none") or "none"
        ratio = ""
        if r["recompute"] == "auto":
            base = none[key]
            ratio = "none has no plan" if base["plan"] is None else f"{r['step_s'] / base['step_s']:.3f}x"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {r['recompute']} | {r['n0']} | {r['pipelines']} | "
                     f"{r['step_s']:.4g} | {recomputing} | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt3-6.7b")
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--microbatch", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--device-memory-gib", type=float, default=80.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [plan_row(gpus=g, device_type=d, f=f, recompute=r, model=args.model, nodes=args.nodes,
                     microbatch=args.microbatch, global_batch=args.global_batch, memory_gib=args.device_memory_gib)
            for g, d, f in CLUSTERS for r in ("none", "auto")]
    print(f"{args.model} on {args.nodes} nodes of {args.device_memory_gib:g} GiB devices, microbatch {args.microbatch}, "
          f"global batch {args.global_batch}")
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"model": args.model, "nodes": args.nodes, "microbatch": args.microbatch,
                                         "global_batch": args.global_batch, "rows": rows}, indent=1))
    worse = [r for r in rows if r["recompute"] == "auto" and r["plan"] is None]
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
