"""`elastic export RUN_DIR --format hf OUT [--step S]`: a run's trained model as a Hugging Face
`transformers` checkpoint: GPT2LMHeadModel, or LlamaForCausalLM for a model of arch llama
(elastic/ops/export.py and elastic/ops/hf_llama.py say what maps to what).

The final state by default, or the checkpoint of step S. Exit codes: 0 written; 1 the run
directory lacks that state or the model has no GPT-2 form; 2 bad flags.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from elastic.cli.main import UsageError

FORMATS = ("hf",)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write a run's trained model as a Hugging Face transformers checkpoint (GPT-2 or Llama)",
        description="Write the final state of the run in RUN_DIR (or its checkpoint of step S) into OUT "
        "as config.json + model.safetensors (+ tokenizer.json when the run's data came with one), "
        "loadable with transformers' GPT2LMHeadModel.from_pretrained(OUT) (LlamaForCausalLM for --model llama-*).",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="an `elastic run` run directory")
    parser.add_argument("--format", required=True, choices=FORMATS, help="hf: a transformers checkpoint")
    parser.add_argument("out", type=Path, metavar="OUT", help="directory to write (created if absent)")
    add_state_arguments(parser)
    parser.set_defaults(func=_run)


def add_state_arguments(parser: argparse.ArgumentParser) -> None:
    """--step (which state of the run); shared with `elastic sample`."""
    parser.add_argument("--step", type=int, default=None, metavar="S",
                        help="the checkpoint of step S (default: the run's final state)")


def load_run(args: argparse.Namespace) -> tuple[Any, dict[str, Any], str]:
    """(job spec, full parameters, where they came from in words) of `args.run_dir` at
    `args.step`; UsageError for a missing directory, RunStateError or CheckpointError otherwise."""
    from elastic.engine.checkpoint.params import checkpoint_params
    from elastic.ops.run_state import final_state, read_spec

    run_dir: Path = args.run_dir
    if not run_dir.is_dir():
        raise UsageError(f"run directory {run_dir} does not exist")
    if args.step is not None and args.step < 0:
        raise UsageError(f"--step must be >= 0, got {args.step}")
    spec = read_spec(run_dir)
    if args.step is None:
        return spec, final_state(spec), f"{run_dir}, final state"
    state = checkpoint_params(run_dir / "checkpoints", args.step, spec.model_config,
                              tp_degree=spec.plan.gpus_per_node)
    return spec, state, f"{run_dir}, checkpoint of step {args.step}"


def _run(args: argparse.Namespace) -> int:
    from elastic.engine.checkpoint.files import CheckpointError
    from elastic.ops.export import ExportError, write_hf
    from elastic.ops.run_state import RunStateError, data_tokenizer

    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"{args.out} exists and is not a directory")
    try:
        spec, state, source = load_run(args)
        tokenizer = data_tokenizer(spec)
        written = write_hf(args.out, state, spec.model_config, tokenizer=tokenizer, source=source)
    except (RunStateError, CheckpointError, ExportError) as exc:
        print(f"elastic export: error: {exc}", file=sys.stderr)
        return 1
    print(f"elastic export: {source} -> {args.out}: {', '.join(p.name for p in written)}"
          + ("" if tokenizer else " (byte-level data: no tokenizer; token id = byte value)"))
    return 0
