"""`elastic profile`: measure a model's per-layer profile on this machine and write it as JSON.

Layers run as the engine runs them on this device (bf16 autocast on CUDA, fp32 on the CPU).
Models too large to run here (or `--mode derive`) get a profile derived from FLOP/byte counts
scaled by this device's measured matmul speed; the file's `source` and `notes` say which. The
memory written is the device's (its reserve for the CUDA context and communicators apart), or
`--memory-gib`.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from elastic.cli.main import UsageError
from elastic.cli.model_flags import add_shape_flags, model_from_flags
from elastic.model.config import PRESETS, describe_model
from elastic.planning.cluster import gpt_layer_counts


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="measure per-layer times and sizes of a model on this machine (JSON)",
        description="Time every planning layer's forward and backward on this device and write the "
        "profile `elastic plan --profile` reads.",
    )
    parser.add_argument("--model", required=True, help=f"model preset ({', '.join(PRESETS)})")
    add_shape_flags(parser)
    parser.add_argument("--microbatch", type=int, required=True, help="samples per microbatch")
    parser.add_argument("--output", type=Path, default=None, help="write the JSON here (default: stdout)")
    parser.add_argument(
        "--mode",
        choices=("auto", "measure", "derive"),
        default="auto",
        help="auto: measure if the model fits and runs quickly here, else derive",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per layer (median kept)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="memory per device (default: the device's; on CUDA a reserve comes off it)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    cfg = model_from_flags(args)
    name = describe_model(args.model, cfg)
    if args.microbatch < 1:
        raise UsageError(f"--microbatch must be >= 1, got {args.microbatch}")
    if args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    if args.memory_gib is not None and not (math.isfinite(args.memory_gib) and args.memory_gib > 0):
        raise UsageError(f"--memory-gib must be a positive number, got {args.memory_gib}")

    # torch is imported here, not at module level, so that `elastic plan` stays light.
    from elastic.engine.device import select_device
    from elastic.planning.memory import compute_dtype
    from elastic.planning.profiler import (
        ProfilerConfig,
        default_memory_bytes,
        derived_from_speed,
        matmul_flops_per_second,
        measure_profile,
        should_measure,
    )

    try:
        device = select_device(0, want=args.device)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    memory = default_memory_bytes(device) if args.memory_gib is None else int(args.memory_gib * 2**30)
    conf = ProfilerConfig(microbatch=args.microbatch, device=device, memory_bytes=memory, repeats=args.repeats)
    counts = gpt_layer_counts(cfg, compute_bytes=compute_dtype(device).itemsize)
    flops = matmul_flops_per_second(device)
    measure = args.mode == "measure" or (args.mode == "auto" and should_measure(cfg, counts, conf, flops))
    if measure:
        profile = measure_profile(name, cfg, counts, conf)
    else:
        profile = derived_from_speed(name, cfg, counts, conf, flops)
    if args.output is None:
        sys.stdout.write(profile.to_json() + "\n")
    else:
        profile.save(args.output)
        print(f"wrote {profile.source} profile of {name} ({profile.num_layers} layers) to {args.output}")
    return 0
