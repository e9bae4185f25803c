"""The full parameters a checkpoint step holds, merged across its tensor-parallel shards: what
`elastic export --step` and `elastic sample --step` read (optimizer state is left out). The
merge is the resharding loader's (`reshard.py`), asked for tensor-parallel degree 1."""

from __future__ import annotations

from pathlib import Path

import torch

from elastic.engine.checkpoint.files import CheckpointError, complete_steps
from elastic.engine.checkpoint.reshard import layer_parameters, load_resharded
from elastic.model.config import GPTConfig
from elastic.transfer.shards import ShardKey

_PARAM = "param/"
"""Prefix of a parameter's entry in a shard (`Trainer.export_shard`)."""


def checkpoint_params(directory: Path, step: int, cfg: GPTConfig, *, tp_degree: int) -> dict[str, torch.Tensor]:
    """Canonical name -> full fp32 tensor of the parameters of checkpoint `step` in `directory`,
    whatever tensor-parallel degree wrote it. CheckpointError (naming the complete steps at the
    run's degree `tp_degree`) if it is missing, incomplete, corrupt or of another model shape."""
    keys = [ShardKey(layer, 0) for layer in range(cfg.num_layers)]
    try:
        shards = load_resharded(directory, step, keys, cfg=cfg, tp_degree=1)
    except CheckpointError as exc:
        steps = complete_steps(directory, num_layers=cfg.num_layers, tp_degree=tp_degree)
        raise CheckpointError(f"{exc} (complete checkpoints: {steps or 'none'})") from None
    out = {name[len(_PARAM):]: t.float() for shard in shards.values() for name, t in shard.items()
           if name.startswith(_PARAM)}
    expected = {name for layer in range(cfg.num_layers) for name in layer_parameters(cfg, layer)}
    if out.keys() != expected:
        odd = sorted(out.keys() ^ expected)
        raise CheckpointError(f"the checkpoint's parameters do not match the model's: {odd[:4]}")
    return out
