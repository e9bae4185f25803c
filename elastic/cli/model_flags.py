"""The model-shape flags shared by `run`, `plan`, `profile` and `simulate`.

A model is a preset (`--model`), changed by a JSON file of GPTConfig fields (`--model-config`),
then by single fields (`--n-layer --d-model --n-head --seq-len --vocab-size`), in that order.
Every command that takes `--model` takes the others, and all of them resolve the shape here.
"""

from __future__ import annotations

import argparse
from typing import Any

from elastic.cli.main import UsageError
from elastic.model.config import (
    PLANNED_RECOMPUTE,
    SHAPE_FIELDS,
    GPTConfig,
    config_from_dict,
    get_preset,
    read_config_file,
)


def add_recompute_flag(parser: Any) -> None:
    """`--recompute auto|none|selective|full`: what the planner lets each stage's backward
    recompute (templates/cost.py; `run` also runs it, model/gpt.py)."""
    parser.add_argument("--recompute", choices=PLANNED_RECOMPUTE, default="auto",
                        help="activation recomputation: auto (default: per stage, the fastest mode that fits), or on "
                        "every stage none, selective (the attention core) or full (each block from its input); the "
                        "gradients are the same, bit for bit")


def add_shard_optimizer_flag(parser: Any) -> None:
    """`--shard-optimizer off|on|auto`: AdamW's moments sharded over each layer's holders, f + 1
    copies of every slice (elastic/engine/optim_shards.py), and the planner counting it
    (`planning.optimizer_choice.choose_plan`)."""
    parser.add_argument("--shard-optimizer", choices=("off", "on", "auto"), default="auto",
                        help="shard AdamW's moments across each layer's holders, f+1 copies of every slice: each "
                        "keeps (f+1)/P of them and updates only its slice; bit-identical. auto (default): on where "
                        "the planner lays a faster plan with the memory it frees")


def virtual_stages_arg(text: str) -> int:
    """`--virtual-stages` value: "auto" (0) or a count >= 1."""
    if text == "auto":
        return 0
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a count >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected auto or a count >= 1, got {value}")
    return value


def add_schedule_flag(parser: Any) -> None:
    """`--virtual-stages N|auto`: model chunks per node, the interleaved schedule (elastic/parallel/interleaved.py)."""
    parser.add_argument("--virtual-stages", type=virtual_stages_arg, default=0, metavar="N|auto",
                        help="model chunks per node in every pipeline of 2 or more nodes: N > 1 runs the "
                        "interleaved 1F1B schedule where the layers and memory allow, 1 plain 1F1B; auto (default) lets the planner "
                        "choose per pipeline size the fastest v that fits")


def add_shape_flags(parser: Any) -> None:
    """Add `--model-config FILE` and one flag per field of SHAPE_FIELDS (`--n-layer`, ...)."""
    group = parser.add_argument_group(
        "model shape", "change the --model preset: a JSON file of GPTConfig fields, then single fields"
    )
    group.add_argument(
        "--model-config",
        default=None,
        metavar="FILE",
        help="JSON object of GPTConfig fields (vocab_size, seq_len, n_layer, n_head, d_model, dropout, "
        "init_seed; arch gpt2|llama, n_kv_heads, ffn_hidden, rope_theta, norm_eps, rope_factor, rope_low_freq_factor, "
        "rope_high_freq_factor, rope_original_context) replacing the preset's",
    )
    for name in SHAPE_FIELDS:
        group.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"the model's {name}")


def shape_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The single-field flags given on the command line (field name -> value)."""
    return {name: getattr(args, name) for name in SHAPE_FIELDS if getattr(args, name, None) is not None}


def model_from_flags(args: argparse.Namespace, *, defaults: dict[str, int] | None = None) -> GPTConfig:
    """The model of the command line: the `--model` preset, then the fields of `--model-config`,
    then `defaults` (fields the command derives, e.g. the vocabulary of prepared data) where
    neither the file nor a flag sets them, then the single-field flags. UsageError (one line,
    exit 2) for an unknown preset or field, or an impossible shape."""
    try:
        base = get_preset(args.model)
        from_file = {} if args.model_config is None else read_config_file(args.model_config)
        if getattr(args, "init_from", None) is not None:  # the checkpoint's shape, under the file's
            from elastic.model.hf_import import hf_shape

            from_file = {**hf_shape(args.init_from), **from_file}
        overrides = shape_overrides(args)
        derived = {k: v for k, v in (defaults or {}).items() if k not in from_file and k not in overrides}
        where = "model shape" if args.model_config is None else f"model config {args.model_config}"
        return config_from_dict({**from_file, **derived, **overrides}, base=base, where=where)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def check_init_from(args: argparse.Namespace, cfg: GPTConfig) -> None:
    """`--init-from DIR`: UsageError (one line, exit 2) unless its tensors are exactly model
    `cfg`'s (names, shapes, dtypes: read from the safetensors headers alone) and, for GPT-2, its
    learned positions cover seq_len."""
    if getattr(args, "init_from", None) is None:
        return
    from elastic.model.hf_import import HfCheckpoint, HfImportError, hf_positions

    try:
        positions = hf_positions(args.init_from)
        if positions is not None and cfg.seq_len > positions:
            raise HfImportError(f"--init-from {args.init_from}: its n_positions={positions} is shorter than "
                                f"seq_len={cfg.seq_len} (--seq-len {positions} at most)")
        HfCheckpoint(args.init_from).check(cfg)
    except HfImportError as exc:
        raise UsageError(str(exc)) from None


def model_for_data(args: argparse.Namespace) -> GPTConfig:
    """`model_from_flags` for a run on `args.data`: with a prepared data directory (meta.json of
    `elastic prepare-data`), the vocabulary defaults to the tokenizer's (rounded up to a multiple
    of --gpus-per-node) and must cover it; UsageError (one line, exit 2) otherwise."""
    from elastic.records.prepared_data import PreparedData

    try:
        prepared = PreparedData.find(args.data)
    except ValueError as exc:
        raise UsageError(f"--data {args.data}: {exc}") from None
    if prepared is None:
        return model_from_flags(args)
    tp = getattr(args, "gpus_per_node", None) or 1
    cfg = model_from_flags(args, defaults={"vocab_size": -(-prepared.vocab_size // tp) * tp})
    try:
        prepared.check_model(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, where=f"--data {args.data}")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return cfg
