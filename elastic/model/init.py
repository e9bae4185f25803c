"""Initialisation independent of the tensor-parallel degree.

Every full parameter is drawn from a generator seeded by (base seed, canonical name), then the
shard of this rank is sliced from it: every layout and every stage split starts from exactly
the same model.
"""

from __future__ import annotations

import hashlib
import math

import torch

from elastic.model.config import GPTConfig, tp_split
from elastic.model.kv_layout import KvGroups
from elastic.model.naming import EMBEDDING, HEAD

STD = 0.02
"""GPT-2's standard deviation for weights."""


def name_seed(base_seed: int, name: str) -> int:
    """A 63-bit seed derived from the base seed and a canonical parameter name."""
    digest = hashlib.sha256(f"{base_seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_initial_value(name: str, shape: tuple[int, ...], cfg: GPTConfig) -> torch.Tensor:
    """The full fp32 initial value of parameter `name` (CPU); a tied head starts as the embedding."""
    if cfg.tie_embeddings and name == HEAD:
        name = EMBEDDING
    leaf = name.rsplit(".", 1)[-1]
    if ".ln" in name:  # LayerNorms: weight 1, bias 0
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    if leaf == "bias":
        return torch.zeros(shape)
    std = STD
    if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
        std = STD / math.sqrt(2 * cfg.n_layer)  # GPT-2: scale residual projections by depth
    generator = torch.Generator(device="cpu").manual_seed(name_seed(cfg.init_seed, name))
    return torch.randn(shape, generator=generator) * std


def shard_shape(full: tuple[int, ...], tp_dim: int | None, size: int, *,
                layout: KvGroups | None = None) -> tuple[int, ...]:
    """The shape of one of `size` shards of a `full`-shaped tensor (`shard_tensor`'s); ValueError
    naming the dimension where the split does not divide."""
    if tp_dim is None:
        return tuple(full)
    rows = layout.local_rows(size) if layout is not None else tp_split(
        full[tp_dim], size, f"dimension {tp_dim} of {tuple(full)}")
    return tuple(rows if i == tp_dim else d for i, d in enumerate(full))


def join_shards(parts: list[torch.Tensor], tp_dim: int | None, *, layout: KvGroups | None = None) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order (`shard_tensor`'s inverse; a
    replicated tensor is rank 0's)."""
    if tp_dim is None:
        return parts[0]
    whole = torch.cat(parts, dim=tp_dim)
    return whole if layout is None else layout.collapse(whole, len(parts))


def shard_tensor(full: torch.Tensor, tp_dim: int | None, rank: int, size: int, *,
                 layout: KvGroups | None = None) -> torch.Tensor:
    """Rank `rank`'s contiguous shard of `full` along `tp_dim` (the whole tensor if None); a
    parameter's `tp_layout` where it has one (`KvGroups.shard`)."""
    if tp_dim is None or size == 1:
        return full
    if layout is not None:
        return layout.shard(full, rank, size)
    tp_split(full.shape[tp_dim], size, f"dimension {tp_dim} of shape {tuple(full.shape)}")
    return full.chunk(size, dim=tp_dim)[rank]
