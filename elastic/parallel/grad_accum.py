"""Gradient accumulation buffers, one per parameter, in a chosen dtype.

Autograd writes each microbatch's gradient into `param.grad`; a post-accumulate hook moves it
into the parameter's buffer and clears `param.grad`. With float64 buffers the sum over the
global batch's microbatches (and, after the cross-pipeline all-reduce, over pipelines) is exact
for fp32 inputs in practice, so the gradient does not depend on how the plan splits the
microbatches across pipelines: it is rounded to fp32 once, after the sum. Without that, the
summation order changes the last bits, and AdamW magnifies last-bit differences on elements
whose gradients nearly cancel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.hooks import RemovableHandle


class GradAccumulator:
    """Per-parameter gradient sums of one step, in `dtype`."""

    def __init__(self, module: torch.nn.Module, *, dtype: torch.dtype = torch.float64) -> None:
        self.dtype = dtype
        self.named = sorted(module.named_parameters(), key=lambda kv: kv[0])
        """(canonical name, parameter), sorted by name."""
        self.buffers: dict[str, torch.Tensor] = {
            name: torch.zeros(p.shape, dtype=dtype, device=p.device) for name, p in self.named
        }
        self._handles: list[RemovableHandle] = []
        for name, p in self.named:
            self._handles.append(p.register_post_accumulate_grad_hook(self._hook(name)))

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        buf = self.buffers[name]

        def move(p: torch.Tensor) -> None:
            assert p.grad is not None
            buf.add_(p.grad)
            p.grad = None

        return move

    def zero(self) -> None:
        for buf in self.buffers.values():
            buf.zero_()

    def write_grads(self) -> None:
        """Round the sums into each parameter's `.grad` (the parameter's dtype) for the optimizer."""
        for name, p in self.named:
            p.grad = self.buffers[name].to(p.dtype)

    def remove(self) -> None:
        """Detach the hooks from the module (the accumulator is no longer used)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
