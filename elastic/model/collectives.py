"""The four differentiable tensor-parallel collectives, each a no-op on a group of size 1.

    copy_to_tp      forward: identity          backward: all-reduce (sum)
    reduce_from_tp  forward: all-reduce (sum)  backward: identity
    gather_from_tp  forward: all-gather (last dim)  backward: keep own slice
    scatter_to_tp   forward: keep own slice (last dim)  backward: all-gather

Every tensor-parallel layer is built from these; they take the group explicitly.
"""

from __future__ import annotations

from typing import Any

import torch

from elastic.model.tensor_parallel import TensorParallel


def _all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    x = x.contiguous().clone()
    tp.all_reduce(x)
    return x


def _all_gather_last(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    tp.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def _own_slice_last(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    width = tp.divide(x.shape[-1], "last dimension")
    return x[..., tp.rank * width : (tp.rank + 1) * width].contiguous()


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
        return _all_gather_last(x, tp)

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
        return _all_gather_last(grad, ctx.tp), None


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
