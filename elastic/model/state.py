"""Full (unsharded) parameter state of a stage: every rank's shards gathered into full tensors."""

from __future__ import annotations

import torch
from torch import nn

from elastic.model.init import join_shards
from elastic.model.kv_layout import KvGroups
from elastic.model.tensor_parallel import TensorParallel


def gather_full(shard: torch.Tensor, tp_dim: int | None, tp: TensorParallel, *,
                layout: KvGroups | None = None) -> torch.Tensor:
    """The full tensor from every rank's shard (a collective over tp.group when sharded); a
    parameter's `tp_layout` where it has one (`KvGroups.collapse`)."""
    if tp_dim is None or tp.size == 1:
        return shard.detach().clone()
    parts = [torch.empty_like(shard) for _ in range(tp.size)]
    tp.all_gather(parts, shard.detach().contiguous())
    return join_shards(parts, tp_dim, layout=layout)


def full_state_dict(module: nn.Module, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """Canonical name -> full fp32 CPU tensor of every parameter of `module`."""
    return {
        name: gather_full(p, p.tp_dim, tp, layout=p.tp_layout).float().cpu()  # type: ignore[attr-defined]
        for name, p in module.named_parameters()
    }
