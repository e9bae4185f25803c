"""Dropout whose masks depend only on (seed, key, site), never on the layout.

A mask is drawn for the full (unsharded) activation and sliced by the caller where the
activation is sharded, so replicated activations get identical masks on every
tensor-parallel rank, and sharded ones (attention heads) get each rank's slice of the one
full mask: a model with dropout computes the same function whatever its TP degree or stages.
"""

from __future__ import annotations

import torch

from elastic.model.init import name_seed


def dropout_mask(
    shape: tuple[int, ...], p: float, *, seed: int, key: int, site: str, device: torch.device
) -> torch.Tensor:
    """Keep-mask scaled by 1/(1-p): multiply an activation of `shape` by it."""
    generator = torch.Generator(device=device).manual_seed(name_seed(seed, f"{key}:{site}"))
    keep = torch.rand(shape, generator=generator, device=device) >= p
    return keep.to(torch.float32) / (1.0 - p)


def apply_dropout(
    x: torch.Tensor, p: float, *, seed: int, key: int, site: str, training: bool, seq_shard: tuple[int, int] = (0, 1)
) -> torch.Tensor:
    """Dropout of a replicated activation (the whole tensor is the full activation), or with
    `seq_shard` = (rank, shards) of shard `rank` of a (batch, seq, ...) activation split along
    the sequence (sequence parallelism): the full mask's rows of that shard."""
    if not training or p == 0.0:
        return x
    rank, shards = seq_shard
    shape = (x.shape[0], x.shape[1] * shards, *x.shape[2:])
    mask = dropout_mask(shape, p, seed=seed, key=key, site=site, device=x.device)
    if shards > 1:  # a copy of the rows: the backward keeps it, not the whole mask
        mask = mask[:, rank * x.shape[1]:(rank + 1) * x.shape[1]].clone()
    return x * mask.to(x.dtype)
