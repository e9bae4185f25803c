"""Deterministic test shards (the same bytes in every process) and a bit-exact comparison."""

from __future__ import annotations

import torch


def make_shard(layer: int, tp_rank: int, *, numel: int = 4096) -> dict[str, torch.Tensor]:
    """Named tensors of one shard: fp32 (non-contiguous), bf16, int64 step, a scalar, an empty one."""
    g = torch.Generator().manual_seed(1000 * layer + tp_rank)
    rows = max(1, numel // 64)
    weight = torch.randn(64, rows, generator=g).t()  # (rows, 64), non-contiguous
    return {
        "weight": weight,
        "exp_avg": torch.randn(numel, generator=g).to(torch.bfloat16),
        "step": torch.tensor(17 + layer, dtype=torch.int64),
        "scale": torch.tensor(0.5 + tp_rank, dtype=torch.float32),
        "empty": torch.empty(0, 3, dtype=torch.float32),
    }


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN-safe, unlike torch.equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def shards_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(bit_equal(got[n], want[n]) for n in want)
