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

from collections.abc import Callable, Collection, Sequence

import torch
from torch.utils.hooks import RemovableHandle


class GradAccumulator:
    """Per-parameter gradient sums of one step, in `dtype`, packed in flat buffers.

    `partition` groups parameter names (every parameter exactly once); each group's sums are
    views into one contiguous buffer, so a gradient bucket is reduced, measured and zeroed
    with one operation each and no copies. Default: one group per parameter, in name order.
    `pad`: per group, a multiple its flat buffer's length is rounded up to (with zeros after the
    views; a reduce-scatter over that many workers splits it evenly). `listener`, when set, is
    called with a parameter's name right after its gradient was added (the bucket reducer
    launches a bucket's reduction once the last backward added all of its gradients).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        dtype: torch.dtype = torch.float64,
        partition: Sequence[Sequence[str]] | None = None,
        pad: Sequence[int] | None = None,
        device: torch.device | None = None,
        attach: bool = True,
    ) -> None:
        """`device`: where the sums live (default: each group's first parameter's device; give
        it for a skeleton module on the meta device). `attach=False`: allocate only; `attach()`
        the module that will train later (the buffers' first-touch cost can then be paid off
        the critical path, e.g. while shards are being received)."""
        self.dtype = dtype
        self.named = sorted(module.named_parameters(), key=lambda kv: kv[0])
        """(canonical name, parameter), sorted by name."""
        params = dict(self.named)
        groups = [[n] for n in params] if partition is None else [list(g) for g in partition]
        listed = [n for g in groups for n in g]
        assert sorted(listed) == sorted(params), "partition must name every parameter exactly once"
        self.flats: list[tuple[tuple[str, ...], torch.Tensor]] = []
        """(names, flat buffer) per partition group."""
        self.buffers: dict[str, torch.Tensor] = {}
        """Canonical name -> its sum (a view into its group's flat buffer)."""
        multiples = [1] * len(groups) if pad is None else list(pad)
        assert len(multiples) == len(groups), "pad needs one multiple per partition group"
        for names, multiple in zip(groups, multiples, strict=True):
            if not names:
                continue
            sizes = [params[n].numel() for n in names]
            length = -(-sum(sizes) // multiple) * multiple
            flat = torch.zeros(length, dtype=dtype, device=device or params[names[0]].device)
            for n, view in zip(names, flat[: sum(sizes)].split(sizes), strict=True):
                self.buffers[n] = view.view(params[n].shape)
            self.flats.append((tuple(names), flat))
        self._copies: list[torch.Tensor] | None = None
        self.listener: Callable[[str], None] | None = None
        """Called with a parameter's name after each gradient added (None: nobody listens)."""
        self.scratch: dict[tuple[int, str, int], torch.Tensor] = {}
        """Work buffers of the bucket reducer, kept across steps: (group, purpose, peer) -> buffer
        (allocating megabytes anew each step costs page faults on every step)."""
        self._handles: list[RemovableHandle] = []
        if attach:
            self.attach(module)

    def attach(self, module: torch.nn.Module) -> None:
        """Sum the gradients of `module`'s parameters (the names and shapes allocated for)."""
        named = sorted(module.named_parameters(), key=lambda kv: kv[0])
        if [(n, tuple(p.shape)) for n, p in named] != [(n, tuple(self.buffers[n].shape)) for n, _ in self.named]:
            raise ValueError("the module's parameters are not the ones these buffers were allocated for")
        self.remove()
        self.named = named
        for name, p in self.named:
            self._handles.append(p.register_post_accumulate_grad_hook(self._hook(name)))

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        buf = self.buffers[name]

        def move(p: torch.Tensor) -> None:
            assert p.grad is not None
            buf.add_(p.grad)
            p.grad = None
            if self.listener is not None:
                self.listener(name)

        return move

    def zero(self) -> None:
        for _, flat in self.flats:
            flat.zero_()

    def flat(self, names: Sequence[str]) -> torch.Tensor:
        """The flat buffer of the partition group `names`."""
        key = tuple(names)
        for group, flat in self.flats:
            if group == key:
                return flat
        raise KeyError(f"no gradient buffer for group {key}")

    def snapshot(self, only: Collection[int] | None = None) -> dict[str, torch.Tensor]:
        """A copy of every sum, by canonical name, in buffers of its own (allocated on the
        first call and reused: the copy of the previous call is overwritten). `only`: copy just
        these groups (indices into `flats`) now, the others were copied earlier in the step
        (the bucket reducer copies each bucket right before its reduction starts)."""
        if self._copies is None:
            self._copies = [torch.empty_like(flat) for _, flat in self.flats]
        out: dict[str, torch.Tensor] = {}
        for i, ((names, flat), copy) in enumerate(zip(self.flats, self._copies, strict=True)):
            if only is None or i in only:
                copy.copy_(flat)
            sizes = [self.buffers[n].numel() for n in names]
            for n, view in zip(names, copy[: sum(sizes)].split(sizes), strict=True):
                out[n] = view.view(self.buffers[n].shape)
        return out

    def add(self, sums: dict[str, torch.Tensor]) -> None:
        """Add gradient sums kept from elsewhere (same names, shapes and dtype) into the buffers."""
        unknown = sorted(set(sums) - set(self.buffers))
        if unknown:
            raise ValueError(f"kept gradient sums for parameters not in this stage: {unknown[:3]}")
        for name, t in sums.items():
            self.buffers[name].add_(t.to(self.buffers[name].device))

    def write_grads(self) -> None:
        """Round the sums into each parameter's `.grad` (the parameter's dtype) for the optimizer."""
        for name, p in self.named:
            p.grad = self.buffers[name].to(p.dtype)

    def remove(self) -> None:
        """Detach the hooks from the module (the accumulator is no longer used)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
