"""Deterministic shards named like `Trainer.export_shard` (same bytes in every process)."""

from __future__ import annotations

import torch

Shards = dict[tuple[int, int], dict[str, torch.Tensor]]


def make_shard(layer: int, tp_rank: int, *, step: int, numel: int = 2048) -> dict[str, torch.Tensor]:
    """fp32 (one non-contiguous), bf16, int64 tensors and the 0-d int64 AdamW step count."""
    g = torch.Generator().manual_seed(100_000 * step + 100 * layer + tp_rank)
    rows = max(1, numel // 32)
    w = f"blocks.{layer}.mlp.weight"
    b = f"blocks.{layer}.norm.bias"
    return {
        f"param/{w}": torch.randn(32, rows, generator=g).t(),  # (rows, 32), non-contiguous
        f"exp_avg/{w}": torch.randn(rows, 32, generator=g),
        f"exp_avg_sq/{w}": torch.rand(rows, 32, generator=g),
        f"param/{b}": torch.randn(numel, generator=g).to(torch.bfloat16),
        f"exp_avg/{b}": torch.randn(numel, generator=g).to(torch.bfloat16),
        f"exp_avg_sq/{b}": torch.randint(-(2**62), 2**62, (7,), generator=g, dtype=torch.int64),
        "step": torch.tensor(step, dtype=torch.int64),
    }


def make_shards(keys: list[tuple[int, int]], *, step: int, numel: int = 2048) -> Shards:
    return {k: make_shard(*k, step=step, numel=numel) for k in keys}


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ab = a.contiguous().reshape(-1).view(torch.uint8)
    bb = b.contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(ab, bb)


def assert_shards_equal(got: Shards, want: Shards) -> None:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for key, tensors in want.items():
        assert got[key].keys() == tensors.keys(), (key, sorted(got[key]), sorted(tensors))
        for name, t in tensors.items():
            assert bit_equal(got[key][name], t), f"shard {key} tensor {name} differs"
