"""The full parameters a checkpoint step holds, merged across its tensor-parallel shards: what
`elastic export --step` and `elastic sample --step` read (optimizer state is left out)."""

from __future__ import annotations

from pathlib import Path

import torch

from elastic.engine.checkpoint import CheckpointError, ShardKey, load_shards
from elastic.engine.checkpoint_files import complete_steps
from elastic.model.config import GPTConfig
from elastic.model.gpt import GPTStage

_PARAM = "param/"
"""Prefix of a parameter's entry in a shard (`Trainer.export_shard`)."""


def checkpoint_params(directory: Path, step: int, cfg: GPTConfig, *, tp_degree: int) -> dict[str, torch.Tensor]:
    """Canonical name -> full fp32 tensor of the parameters of checkpoint `step` in `directory`.
    CheckpointError (naming the complete steps) if it is missing, incomplete or unreadable."""
    keys = [ShardKey(layer, t) for layer in range(cfg.num_layers) for t in range(tp_degree)]
    try:
        shards = load_shards(directory, step, keys)
    except CheckpointError as exc:
        steps = complete_steps(directory, num_layers=cfg.num_layers, tp_degree=tp_degree)
        raise CheckpointError(f"{exc} (complete checkpoints: {steps or 'none'})") from None
    return merge_shards({k: {n[len(_PARAM):]: v for n, v in s.items() if n.startswith(_PARAM)}
                         for k, s in shards.items()}, cfg)


def merge_shards(shards: dict[ShardKey, dict[str, torch.Tensor]], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Full tensors from tensor-parallel shards {(layer, tp_rank): {canonical name: slice}}: the
    slices of a sharded parameter are contiguous along its `tp_dim`, in rank order
    (`model.init.shard_tensor`); a replicated one is taken from rank 0."""
    with torch.device("meta"):
        model = GPTStage(cfg, initialise=False)
    tp_dims = {name: p.tp_dim for name, p in model.named_parameters()}  # type: ignore[attr-defined]
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for key, tensors in shards.items():
        for name, tensor in tensors.items():
            parts.setdefault(name, []).append((key.tp_rank, tensor))
    if parts.keys() != tp_dims.keys():
        odd = sorted(parts.keys() ^ tp_dims.keys())
        raise CheckpointError(f"the checkpoint's parameters do not match the model's: {odd[:4]}")
    out = {}
    for name, ranked in parts.items():
        ordered = [t for _, t in sorted(ranked, key=lambda rt: rt[0])]
        dim = tp_dims[name]
        out[name] = (ordered[0] if dim is None else torch.cat(ordered, dim=dim)).float()
    return out
