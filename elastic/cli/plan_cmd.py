"""`elastic plan`: pipeline templates and the plan for a cluster, from a preset and a profile.

Without `--profile` the profile is derived from the preset's FLOP and byte counts on a nominal
device (`--device-tflops`, `--device-memory-gib`), so the command answers instantly. `--device
cuda` plans for CUDA workers: bf16 activations (autocast), a reserve for the context and the
communicators, and by default the memory of this machine's GPU when it has one. `--recompute
auto` (the default) lets each stage trade its activations for recomputation where that is
faster or needed to fit; the table marks such stages "+selective" or "+full".
"""

from __future__ import annotations

import argparse
import collections
import json
from typing import Any

from elastic.cli.main import UsageError
from elastic.cli.model_flags import (
    add_recompute_flag,
    add_schedule_flag,
    add_shape_flags,
    add_shard_optimizer_flag,
    model_from_flags,
)
from elastic.model.config import PRESETS, RECOMPUTE_MODES, GPTConfig, describe_model
from elastic.planning.cluster import DEFAULT_MEMORY_GIB, DEFAULT_TFLOPS, ClusterSpec, memory_gib
from elastic.planning.footprint import DEVICE_TYPES
from elastic.planning.optimizer_choice import ChosenPlan, choose_plan
from templates.plan import Plan, describe_ranges
from templates.search import PipelineTemplate


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="pipeline templates and the fastest plan for a cluster",
        description="Compute the exact best pipeline template for every pipeline size and the fastest "
        "instantiation over N nodes with at least f+1 pipelines.",
    )
    parser.add_argument("--model", required=True, help=f"model preset ({', '.join(PRESETS)})")
    add_shape_flags(parser)
    parser.add_argument("--nodes", type=int, required=True, help="N: live nodes")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="G: devices per node (TP degree)")
    parser.add_argument("--fault-tolerance", type=int, default=0, help="f: keep at least f+1 pipelines")
    parser.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    parser.add_argument("--microbatch", type=int, required=True, help="samples per microbatch")
    parser.add_argument("--profile", default=None, help="profile JSON (default: derived from the preset)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--device-tflops", type=float, default=DEFAULT_TFLOPS, help="derived profile: achieved TFLOP/s per device"
    )
    parser.add_argument(
        "--device-memory-gib", type=float, default=None,
        help=f"derived profile: GiB per device (default {DEFAULT_MEMORY_GIB:g}; with --device cuda, this machine's GPU's)",
    )
    parser.add_argument("--device", choices=DEVICE_TYPES, default="cpu",
                        help="device type the workers compute on (cuda: bf16 activations, a reserve per device)")
    add_recompute_flag(parser)
    add_schedule_flag(parser)
    add_shard_optimizer_flag(parser)
    parser.set_defaults(func=_run)


def _memory_gib(args: argparse.Namespace) -> float:
    """--device-memory-gib, or the device's (`planning.cluster.memory_gib`)."""
    return memory_gib(args.device_memory_gib, args.device, profile=args.profile)


def _run(args: argparse.Namespace) -> int:
    cfg = model_from_flags(args)
    try:
        spec = ClusterSpec(
            model=args.model,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            fault_tolerance=args.fault_tolerance,
            global_batch=args.global_batch,
            microbatch=args.microbatch,
            profile_path=args.profile,
            device_tflops=args.device_tflops,
            device_memory_gib=_memory_gib(args),
            shape=cfg,
            device_type=args.device,
            recompute=args.recompute,
            virtual_stages=args.virtual_stages,
        )
        chosen = choose_plan(spec, args.shard_optimizer)
    except ValueError as exc:  # bad flags, a malformed profile, or no feasible plan
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps({**_as_json(args, cfg, chosen), "memory": _memory(chosen)}, indent=2))
    else:
        print(_as_table(args, cfg, chosen))
        print(_memory_line(chosen))
    return 0


def _memory(chosen: ChosenPlan) -> dict[str, Any]:
    """The plan's largest worker by the memory model (`planning.memory.plan_memory`), in bytes."""
    peak = chosen.memory
    assert peak is not None
    e = peak.estimate
    return {"largest_worker_bytes": e.total, "params_and_state": e.params_and_state, "activations": e.activations,
            "head": e.head, "reserve": e.reserve, "pipeline": peak.pipeline, "stage": peak.stage, "node": peak.node,
            "device_memory_bytes": chosen.tset.profile.device.memory_bytes, "fits": chosen.fits,
            "margin_bytes": chosen.margin_bytes}


def _memory_line(chosen: ChosenPlan) -> str:
    m, gib = _memory(chosen), 2**30
    margin = (f"\nmemory: planned with {m['margin_bytes'] / 2**20:.2f} MiB held back on every worker: the first "
              "plan's uneven batch split left a worker over the device" if m["margin_bytes"] else "")
    return (f"\nmemory: largest worker {m['largest_worker_bytes'] / gib:.2f} GiB of {m['device_memory_bytes'] / gib:g} GiB "
            f"(pipeline {m['pipeline']} stage {m['stage']}, node {m['node']}): parameters and state "
            f"{m['params_and_state'] / gib:.2f}, activations {m['activations'] / gib:.2f}, loss {m['head'] / gib:.2f}, "
            f"reserve {m['reserve'] / gib:.2f}" + margin + ("" if m["fits"] else OVER_DEVICE))


OVER_DEVICE = ("\nmemory: WARNING: the largest worker exceeds the device by the memory model. The planner's "
               "gradient-buffer figure bounds even batch splits; this plan splits its batch unevenly between "
               "pipelines of different depths, a holder whose share of the summation tree has more blocks keeps "
               "more gradient sums, and no plan holding the excess back on every worker fitted. Try another "
               "--global-batch, or more --device-memory-gib headroom.")


def _optimizer(args: argparse.Namespace, chosen: ChosenPlan) -> dict[str, Any]:
    """How the plan's optimizer state is kept (`optimizer` of --json)."""
    f = chosen.plan.fault_tolerance
    return {
        "shard_optimizer": args.shard_optimizer,
        "sharded": chosen.sharded,
        "slices": chosen.slices,
        "counted_slices": chosen.counted_slices,
        "owners_per_slice": len(chosen.plan.pipelines) // chosen.slices,
        "moment_share": 1.0 / chosen.slices,
        "fault_tolerance": f,
        "unsharded_iteration_time": chosen.unsharded_time,
        "gather_time": chosen.gather_time,
    }


def _optimizer_summary(args: argparse.Namespace, chosen: ChosenPlan) -> str:
    """The table's line on the optimizer state: sharded or not, and why for auto."""
    head = f"optimizer {args.shard_optimizer}: "
    if not chosen.sharded:
        why = " (auto: sharding lays no faster plan here, or f = 0)" if args.shard_optimizer == "auto" else ""
        return head + f"every holder keeps its layers' whole AdamW moments{why}"
    p, s = len(chosen.plan.pipelines), chosen.slices
    plain = ("no plan fits with whole moments" if chosen.unsharded_time is None
             else f"unsharded plan {chosen.unsharded_time:.6g} s an iteration")
    return (head + f"sharded: each layer's moments in {s} slice(s) over its {p} holders, {p // s}+ owners each; a "
            f"holder keeps 1/{s} of them; its parameter gather, less what the first forward hides, "
            f"{chosen.gather_time:.3g} s a step on top ({plain}; "
            f"the leader's re-plans count 1/{chosen.counted_slices} wherever the live nodes form "
            f"{chosen.counted_slices * (chosen.plan.fault_tolerance + 1)} pipelines)")


def _as_json(args: argparse.Namespace, cfg: GPTConfig, chosen: ChosenPlan) -> dict[str, Any]:
    tset, plan = chosen.tset, chosen.plan
    return {
        "model": args.model,
        "shape": cfg.as_dict(),
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "fault_tolerance": args.fault_tolerance,
        "global_batch": args.global_batch,
        "microbatch": args.microbatch,
        "profile": {"source": tset.profile.source, "notes": tset.profile.notes},
        "min_nodes": tset.min_nodes,
        "max_nodes": tset.max_nodes,
        "templates": tset.to_list(),
        "plan": plan.to_dict(),
        "optimizer": _optimizer(args, chosen),
    }


def _mark(mode: str) -> str:
    """A stage's recomputation after its layers: nothing for "none", else "+selective" / "+full"."""
    return "" if mode == "none" else f"+{mode}"


def _ranges(template: PipelineTemplate) -> str:
    chunks = template.chunks or tuple((rng,) for rng in template.stages)
    return " ".join(f"{describe_ranges(rs)}{_mark(m)}" for rs, m in zip(chunks, template.stage_modes, strict=True))


def _schedule_summary(args: argparse.Namespace, plan: Plan) -> str:
    """The schedule of each pipeline: plain 1F1B, or interleaved with v chunks per node."""
    asked = "auto" if args.virtual_stages == 0 else str(args.virtual_stages)
    vs = [p.virtual_stages for p in plan.pipelines]
    if all(v == 1 for v in vs):
        return f"virtual stages {asked}: plain 1F1B in every pipeline"
    return (f"virtual stages {asked}: interleaved 1F1B, v per pipeline {vs} (a node's chunks are joined by +; "
            "chunk c of stage s is virtual stage c*p+s)")


def _recompute_summary(plan: Plan) -> str:
    """How many of the plan's stages recompute what ("+mode" marks them below)."""
    modes = collections.Counter(st.recompute for pipe in plan.pipelines for st in pipe.stages)
    if set(modes) == {"none"}:
        return "every stage keeps its activations"
    counts = ", ".join(f"{modes[m]} {m}" for m in RECOMPUTE_MODES if modes[m])
    return f"stages of the plan: {counts} (marked +selective / +full below; unmarked stages keep everything)"


def _as_table(args: argparse.Namespace, cfg: GPTConfig, chosen: ChosenPlan) -> str:
    tset, plan = chosen.tset, chosen.plan
    lines = [
        f"model {describe_model(args.model, cfg)}: {tset.num_layers} planning layers; profile {tset.profile.source} "
        f"({tset.profile.notes.split(';')[0]})",
        f"cluster: {args.nodes} nodes x {args.gpus_per_node} devices, f = {args.fault_tolerance}, "
        f"global batch {args.global_batch} = {plan.global_microbatches} microbatches of {args.microbatch}",
        f"templates for n in [{tset.min_nodes}, {tset.max_nodes}] (n0 = {tset.min_nodes}: fewest nodes that hold the model)",
        f"recompute {args.recompute}: {_recompute_summary(plan)}",
        _schedule_summary(args, plan),
        _optimizer_summary(args, chosen),
        "",
        f"{'nodes':>5}  {'v':>2}  {'mbs':>5}  {'slowest stage s':>15}  {'iteration s':>12}  {'vs v=1':>6}  "
        "stages (layers)",
    ]
    for n in tset.sizes:
        t = tset.templates[n]
        lines.append(
            f"{n:>5}  {t.virtual_stages:>2}  {t.microbatches:>5}  {t.bottleneck:>15.6g}  {t.iteration_time:>12.6g}  "
            f"{t.iteration_time / t.plain_time_for(t.microbatches):>6.3f}  {_ranges(t)}"
        )
    lines += ["", f"plan: {len(plan.pipelines)} pipelines, estimated iteration time {plan.iteration_time:.6g} s", ""]
    lines.append(f"{'pipe':>4}  {'nodes':>5}  {'v':>2}  {'mbs':>5}  {'iteration s':>12}  node:[layers)")
    for p, pipe in enumerate(plan.pipelines):
        stages = " ".join(f"{st.node}:{describe_ranges(st.ranges)}{_mark(st.recompute)}" for st in pipe.stages)
        lines.append(f"{p:>4}  {len(pipe.stages):>5}  {pipe.virtual_stages:>2}  {pipe.microbatches:>5}  "
                     f"{pipe.iteration_time:>12.6g}  {stages}")
    return "\n".join(lines)
