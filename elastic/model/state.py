"""Full (unsharded) parameter state of a stage: gather shards, load full tensors back."""

from __future__ import annotations

import torch
from torch import nn

from elastic.model.init import shard_tensor
from elastic.model.tensor_parallel import TensorParallel


def gather_full(shard: torch.Tensor, tp_dim: int | None, tp: TensorParallel) -> torch.Tensor:
    """The full tensor from every rank's shard (a collective over tp.group when sharded)."""
    if tp_dim is None or tp.size == 1:
        return shard.detach().clone()
    parts = [torch.empty_like(shard) for _ in range(tp.size)]
    tp.all_gather(parts, shard.detach().contiguous())
    return torch.cat(parts, dim=tp_dim)


def full_state_dict(module: nn.Module, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """Canonical name -> full fp32 CPU tensor of every parameter of `module`."""
    return {
        name: gather_full(p, p.tp_dim, tp).float().cpu()  # type: ignore[attr-defined]
        for name, p in module.named_parameters()
    }


def full_grad_dict(module: nn.Module, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """Canonical name -> full fp32 CPU gradient of every parameter that has one."""
    out = {}
    for name, p in module.named_parameters():
        if p.grad is not None:
            out[name] = gather_full(p.grad, p.tp_dim, tp).float().cpu()  # type: ignore[attr-defined]
    return out


def load_full_state(module: nn.Module, state: dict[str, torch.Tensor], tp: TensorParallel) -> None:
    """Copy this rank's shard of each full tensor in `state` into `module`'s parameters."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name not in state:
                raise KeyError(f"state has no tensor for parameter {name!r}")
            full = state[name]
            if tuple(full.shape) != tuple(p.full_shape):  # type: ignore[attr-defined]
                raise ValueError(f"{name}: state shape {tuple(full.shape)} != model shape {p.full_shape}")  # type: ignore[attr-defined]
            p.copy_(shard_tensor(full, p.tp_dim, tp.rank, tp.size))  # type: ignore[attr-defined]
