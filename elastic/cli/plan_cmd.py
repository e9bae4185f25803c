"""`elastic plan`: pipeline templates and the plan for a cluster, from a preset and a profile.

Without `--profile` the profile is derived from the preset's FLOP and byte counts on a nominal
device (`--device-tflops`, `--device-memory-gib`), so the command answers instantly.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from elastic.cli.main import UsageError
from elastic.model.config import PRESETS, GPTConfig, get_preset
from templates.derive import DeviceSpeed, LayerCounts, derive_profile
from templates.instantiation import instantiate
from templates.plan import Plan
from templates.profile import Profile, ProfileError
from templates.template_set import PlanningError, TemplateSet, build_templates

DEFAULT_TFLOPS = 100.0
"""Nominal achieved TFLOP/s of one device for derived profiles."""
DEFAULT_MEMORY_GIB = 80.0
"""Nominal memory of one device for derived profiles."""


def gpt_layer_counts(cfg: GPTConfig) -> list[LayerCounts]:
    """The planner's plain description of each planning layer of `cfg`.

    Saved activations per token (no recomputation, dropout masks not counted): a block keeps
    16 * d_model elements (LayerNorm, QKV, q, k, v, projection, MLP inputs, the 4x-wide GELU
    input and output) plus 2 * n_head * seq_len (attention scores and softmax output); the head
    keeps its two d_model-wide inputs and the logits; the embedding keeps only token ids.
    Tensor-parallel all-reduces per microbatch: 4 per block (2 forward, 2 backward), 1 for the
    vocabulary-parallel embedding, 1 for the head's input gradient.
    """
    d = cfg.d_model
    out = []
    for i in range(cfg.num_layers):
        kind = cfg.layer_kind(i)
        if kind == "embedding":
            saved, allreduces = 0.0, 1
        elif kind == "head":
            saved, allreduces = 2.0 * d + cfg.vocab_size, 1
        else:
            saved, allreduces = 16.0 * d + 2.0 * cfg.n_head * cfg.seq_len, 4
        out.append(
            LayerCounts(
                kind=kind,
                params=cfg.layer_param_count(i),
                flops_per_token=cfg.layer_flops_per_token(i),
                saved_elements_per_token=saved,
                output_elements_per_token=d,
                tp_allreduces=allreduces,
            )
        )
    return out


def derived_profile(name: str, cfg: GPTConfig, microbatch: int, device: DeviceSpeed) -> Profile:
    return derive_profile(
        model=name, layers=gpt_layer_counts(cfg), seq_len=cfg.seq_len, microbatch_size=microbatch, device=device
    )


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="pipeline templates and the fastest plan for a cluster",
        description="Compute the exact best pipeline template for every pipeline size and the fastest "
        "instantiation over N nodes with at least f+1 pipelines.",
    )
    parser.add_argument("--model", required=True, help=f"model preset ({', '.join(PRESETS)})")
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
        "--device-memory-gib", type=float, default=DEFAULT_MEMORY_GIB, help="derived profile: GiB per device"
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        cfg = get_preset(args.model)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for flag, value in (
        ("nodes", args.nodes),
        ("gpus-per-node", args.gpus_per_node),
        ("global-batch", args.global_batch),
        ("microbatch", args.microbatch),
    ):
        if value < 1:
            raise UsageError(f"--{flag} must be >= 1, got {value}")
    f = args.fault_tolerance
    if f < 0:
        raise UsageError(f"--fault-tolerance must be >= 0, got {f}")
    if args.global_batch % args.microbatch:
        raise UsageError(f"--microbatch {args.microbatch} does not divide --global-batch {args.global_batch}")
    microbatches = args.global_batch // args.microbatch
    if f + 1 > args.nodes:
        raise UsageError(f"--fault-tolerance {f} needs at least {f + 1} nodes (one per pipeline), got {args.nodes}")
    if microbatches < f + 1:
        raise UsageError(
            f"{microbatches} microbatches ({args.global_batch}/{args.microbatch}) cannot feed the "
            f"{f + 1} pipelines --fault-tolerance {f} needs"
        )
    profile = _profile(args, cfg)
    try:
        tset = build_templates(
            profile,
            gpus_per_node=args.gpus_per_node,
            num_nodes=args.nodes,
            fault_tolerance=f,
            global_microbatches=microbatches,
        )
        plan = instantiate(tset, list(range(args.nodes)), global_microbatches=microbatches, fault_tolerance=f)
    except PlanningError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(_as_json(args, tset, plan), indent=2))
    else:
        print(_as_table(args, tset, plan))
    return 0


def _profile(args: argparse.Namespace, cfg: GPTConfig) -> Profile:
    if args.profile is None:
        tflops, gib = args.device_tflops, args.device_memory_gib
        if not (math.isfinite(tflops) and tflops > 0):
            raise UsageError(f"--device-tflops must be a positive number, got {tflops}")
        if not (math.isfinite(gib) and gib > 0):
            raise UsageError(f"--device-memory-gib must be a positive number, got {gib}")
        device = DeviceSpeed(
            flops_per_second=tflops * 1e12,
            memory_bytes=int(gib * 2**30),
            description=f"nominal device: {tflops:g} TFLOP/s, {gib:g} GiB",
        )
        return derived_profile(args.model, cfg, args.microbatch, device)
    try:
        profile = Profile.load(args.profile)
    except ProfileError as exc:
        raise UsageError(str(exc)) from None
    if profile.num_layers != cfg.num_layers:
        raise UsageError(
            f"profile {args.profile} has {profile.num_layers} layers but {args.model} has {cfg.num_layers}"
        )
    if profile.microbatch_size != args.microbatch:
        raise UsageError(
            f"profile {args.profile} was taken at microbatch {profile.microbatch_size}, not {args.microbatch}"
        )
    return profile


def _as_json(args: argparse.Namespace, tset: TemplateSet, plan: Plan) -> dict[str, Any]:
    return {
        "model": args.model,
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
    }


def _ranges(stages: Any) -> str:
    return " ".join(f"[{a},{b})" for a, b in stages)


def _as_table(args: argparse.Namespace, tset: TemplateSet, plan: Plan) -> str:
    lines = [
        f"model {args.model}: {tset.num_layers} planning layers; profile {tset.profile.source} "
        f"({tset.profile.notes.split(';')[0]})",
        f"cluster: {args.nodes} nodes x {args.gpus_per_node} devices, f = {args.fault_tolerance}, "
        f"global batch {args.global_batch} = {plan.global_microbatches} microbatches of {args.microbatch}",
        f"templates for n in [{tset.min_nodes}, {tset.max_nodes}] (n0 = {tset.min_nodes}: fewest nodes that hold the model)",
        "",
        f"{'nodes':>5}  {'mbs':>5}  {'slowest stage s':>15}  {'iteration s':>12}  stages (layers)",
    ]
    for n in tset.sizes:
        t = tset.templates[n]
        lines.append(
            f"{n:>5}  {t.microbatches:>5}  {t.bottleneck:>15.6g}  {t.iteration_time:>12.6g}  {_ranges(t.stages)}"
        )
    lines += ["", f"plan: {len(plan.pipelines)} pipelines, estimated iteration time {plan.iteration_time:.6g} s", ""]
    lines.append(f"{'pipe':>4}  {'nodes':>5}  {'mbs':>5}  {'iteration s':>12}  node:[layers)")
    for p, pipe in enumerate(plan.pipelines):
        stages = " ".join(f"{st.node}:[{st.first},{st.last})" for st in pipe.stages)
        lines.append(f"{p:>4}  {len(pipe.stages):>5}  {pipe.microbatches:>5}  {pipe.iteration_time:>12.6g}  {stages}")
    return "\n".join(lines)
