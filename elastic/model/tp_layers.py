"""Megatron-style tensor-parallel layers, built from the four collectives.

Each parameter carries three attributes used by initialisation, checkpointing and shard transfer:
`tp_dim` (the dimension split across tensor-parallel ranks, or None when replicated),
`full_shape` (its unsharded shape) and `tp_layout` (None: contiguous chunks of `tp_dim`; a
`KvGroups`: grouped-query attention's qkv rows, key/value heads replicated where the degree
exceeds their number, model/kv_layout.py).

With `sequence_parallel` (Korthikanti et al., 2022) the activations between the tensor-parallel
regions are split along the sequence: a column-parallel layer all-gathers its input shard (and
keeps only the shard for its backward), a row-parallel layer reduce-scatters its output instead
of all-reducing it, and a replicated parameter used on a shard (a row-parallel bias) has its
gradient summed over the ranks (`copy_to_tp`), each rank having seen only its tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from elastic.model.collectives import (
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_seq,
    seq_parallel_linear,
)
from elastic.model.init import shard_shape
from elastic.model.kv_layout import KvGroups
from elastic.model.tensor_parallel import TensorParallel


def sharded_parameter(full_shape: tuple[int, ...], tp_dim: int | None, tp: TensorParallel,
                      layout: KvGroups | None = None) -> nn.Parameter:
    """An uninitialised parameter holding this rank's shard of a `full_shape` tensor (`layout`:
    the rows of a grouped qkv weight, split along dimension 0)."""
    assert layout is None or tp_dim == 0, "a KvGroups layout splits rows"
    param = nn.Parameter(torch.empty(shard_shape(full_shape, tp_dim, tp.size, layout=layout)))
    param.tp_dim = tp_dim  # type: ignore[attr-defined]
    param.full_shape = tuple(full_shape)  # type: ignore[attr-defined]
    param.tp_layout = layout  # type: ignore[attr-defined]
    return param


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows: each rank computes a slice of the outputs.

    Input is replicated across ranks (with `sequence_parallel`: this rank's sequence shard,
    all-gathered here); output is this rank's slice unless `gather_output`.
    """

    def __init__(
        self, in_features: int, out_features: int, *, tp: TensorParallel, bias: bool = True, gather_output: bool = False,
        sequence_parallel: bool = False, layout: KvGroups | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.weight = sharded_parameter((out_features, in_features), 0, tp, layout)
        self.bias = sharded_parameter((out_features,), 0, tp, layout) if bias else None

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`weight`, `bias`: stand-ins for the parameters (ones whose gradient the caller treats, as
        `kv_layout.sum_replica_grads`); by default the parameters themselves."""
        w = self.weight if weight is None else weight
        b = self.bias if bias is None else bias
        if self.sequence_parallel:
            y = seq_parallel_linear(x, w, b, self.tp)
        else:
            y = F.linear(copy_to_tp(x, self.tp), w, b)
        return gather_from_tp(y, self.tp) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns: each rank takes a slice of the inputs.

    Partial products are summed across ranks (with `sequence_parallel`: reduce-scattered along
    the sequence); the bias is added once, after the sum.
    """

    def __init__(self, in_features: int, out_features: int, *, tp: TensorParallel, bias: bool = True,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.sequence_parallel = sequence_parallel
        self.weight = sharded_parameter((out_features, in_features), 1, tp)
        self.bias = sharded_parameter((out_features,), None, tp) if bias else None

    def forward(self, x_shard: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`bias`: a stand-in for the bias (with `sequence_parallel`: one whose gradient the
        caller sums over the ranks, `copy_params_to_tp`); by default the bias itself."""
        partial = F.linear(x_shard, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_seq(partial, self.tp)
            if self.bias is None:
                return y
            return y + (bias if bias is not None else copy_to_tp(self.bias, self.tp))
        y = reduce_from_tp(partial, self.tp)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks; lookups are summed across ranks
    (with `sequence_parallel`: reduce-scattered along the sequence)."""

    def __init__(self, vocab_size: int, dim: int, *, tp: TensorParallel, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.sequence_parallel = sequence_parallel
        self.weight = sharded_parameter((vocab_size, dim), 0, tp)
        self.vocab_start = tp.rank * self.weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (batch, seq, dim)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_seq(out, self.tp) if self.sequence_parallel else reduce_from_tp(out, self.tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary, without gathering them."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        # logits: (tokens, vocab_shard); targets: (tokens,). The loss is computed in float32 at
        # least (bf16 logits under autocast are widened), in float64 when the logits are.
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        local_max = logits.max(dim=-1).values
        if tp.size > 1:
            tp.all_reduce(local_max, op=dist.ReduceOp.MAX)
        shifted = logits - local_max.unsqueeze(-1)
        vocab_shard = logits.shape[-1]
        start = tp.rank * vocab_shard
        local_target = targets - start
        outside = (local_target < 0) | (local_target >= vocab_shard)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if tp.size > 1:
            both = torch.stack([target_logit, sum_exp])
            tp.all_reduce(both)
            target_logit, sum_exp = both[0], both[1]
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local_target, outside)
        return torch.log(sum_exp) - target_logit  # (tokens,)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local_target, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
        grad_logits[rows, local_target] -= (~outside).to(grad_logits.dtype)
        return grad_logits * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Per-token loss (same leading shape as `targets`) from vocabulary-sharded logits."""
    flat = _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), tp)
    return flat.reshape(targets.shape)
