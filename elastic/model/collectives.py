"""The differentiable tensor-parallel collectives, each a no-op on a group of size 1.

    copy_to_tp      forward: identity          backward: all-reduce (sum)
    reduce_from_tp  forward: all-reduce (sum)  backward: identity
    gather_from_tp  forward: all-gather (last dim)  backward: keep own slice
    scatter_to_tp   forward: keep own slice (last dim)  backward: all-gather

and, for sequence parallelism (activations of shape (batch, seq, ...) split along seq):

    gather_seq          forward: all-gather (seq)      backward: reduce-scatter (seq)
    reduce_scatter_seq  forward: reduce-scatter (seq)  backward: all-gather (seq)
    seq_parallel_linear forward: all-gather (seq), then the column-parallel linear; it keeps
                        only the local sequence shard, and gathers it again in the backward
    copy_params_to_tp   forward: the parameters themselves  backward: one all-reduce (sum) of
                        all their gradients together (replicated parameters used on a shard)

Every tensor-parallel layer is built from these; they take the group explicitly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from elastic.model.tensor_parallel import TensorParallel


def _all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    x = x.contiguous().clone()
    tp.all_reduce(x)
    return x


def _all_gather(x: torch.Tensor, tp: TensorParallel, *, dim: int) -> torch.Tensor:
    """Every rank's `x`, concatenated along `dim` in rank order (the last dimension's shards,
    or with dim 1 the sequence's: (batch, seq / tp, ...) -> (batch, seq, ...))."""
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    tp.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def _own_slice_last(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    width = tp.divide(x.shape[-1], "last dimension")
    return x[..., tp.rank * width : (tp.rank + 1) * width].contiguous()


def _reduce_scatter_seq(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """(batch, seq, ...) partial sums on each rank -> rank r's sequence shard of their sum."""
    shard = tp.divide(x.shape[1], "sequence length")
    seq_first = x.transpose(0, 1).contiguous()  # the collective splits the first dimension
    out = torch.empty((shard, *seq_first.shape[1:]), dtype=x.dtype, device=x.device)
    tp.reduce_scatter(out, seq_first)
    return out.transpose(0, 1).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return _all_gather(x, tp, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _own_slice_last(grad, ctx.tp), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return _own_slice_last(x, tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.tp, dim=-1), None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return _all_gather(x, tp, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter_seq(grad, ctx.tp), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return _reduce_scatter_seq(x, tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.tp, dim=1), None


class _SeqParallelLinear(torch.autograd.Function):
    """y = gather_seq(x) W^T + b, keeping x's sequence shard (not the gathered input) for the
    backward, which gathers it again to form W's gradient (Korthikanti et al., 2022)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                tp: TensorParallel) -> torch.Tensor:
        ctx.tp, ctx.has_bias = tp, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_all_gather(x, tp, dim=1), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad_x = _reduce_scatter_seq(grad @ weight.to(grad.dtype), ctx.tp).to(x.dtype)
        full = _all_gather(x, ctx.tp, dim=1).to(grad.dtype)
        flat = grad.reshape(-1, grad.shape[-1])
        grad_w = (flat.t() @ full.reshape(-1, full.shape[-1])).to(weight.dtype)
        grad_b = flat.sum(dim=0).to(weight.dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class _CopyParamsToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tp: TensorParallel, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.tp = tp
        return tuple(p.view_as(p) for p in params)  # the parameters' own storage: nothing kept

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        flat = torch.cat([g.reshape(-1) for g in grads])
        ctx.tp.all_reduce(flat)
        parts = flat.split([g.numel() for g in grads])
        return (None, *(part.view_as(g) for part, g in zip(parts, grads, strict=True)))


def copy_params_to_tp(tp: TensorParallel, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Replicated parameters for use on this rank's part of the data: their gradients are summed
    over the ranks, all in one all-reduce (module doc)."""
    return params if tp.size == 1 else _CopyParamsToTP.apply(tp, *params)


def copy_to_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, sum the gradients backward."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Leave a tensor-parallel region by summing partial results: all-reduce forward."""
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


def gather_from_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Concatenate every rank's last-dimension shard (forward); keep own slice (backward)."""
    return x if tp.size == 1 else _GatherFromTP.apply(x, tp)


def scatter_to_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Keep this rank's last-dimension slice (forward); all-gather the gradient (backward)."""
    return x if tp.size == 1 else _ScatterToTP.apply(x, tp)


def gather_seq(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Leave a sequence-parallel region: all-gather the sequence (forward), reduce-scatter (backward)."""
    return x if tp.size == 1 else _GatherSeq.apply(x, tp)


def reduce_scatter_seq(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Enter a sequence-parallel region from partial sums: reduce-scatter the sequence (forward),
    all-gather (backward)."""
    return x if tp.size == 1 else _ReduceScatterSeq.apply(x, tp)


def seq_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        tp: TensorParallel) -> torch.Tensor:
    """The column-parallel linear of a sequence-parallel input shard (module doc)."""
    if tp.size == 1:
        return F.linear(x, weight, bias)
    return _SeqParallelLinear.apply(x, weight, bias, tp)
