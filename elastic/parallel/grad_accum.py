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

from collections.abc import Callable, Sequence

import torch
from torch.utils.hooks import RemovableHandle


class GradAccumulator:
    """Per-parameter gradient sums of one step, in `dtype`, packed in flat buffers, and the
    step's reduced gradient beside them.

    `partition` groups parameter names (every parameter exactly once); each group's sums are
    views into one contiguous buffer, so a gradient bucket is reduced, measured and zeroed
    with one operation each and no copies. Default: one group per parameter, in name order.
    `pad`: per group, a multiple its flat buffer's length is rounded up to (with zeros after the
    views; a reduce-scatter over that many workers splits it evenly). `listener`, when set, is
    called with a parameter's name right after its gradient was added (the bucket reducer
    launches a bucket's reduction once the last backward added all of its gradients).

    Each group also has a `reduced` flat buffer in the parameters' dtype: the cross-pipeline
    reduction writes the step's gradient there (never into the sums, which stay this worker's
    own until `zero()`, so a step abandoned mid-reduction still has them for partial replay), and
    `write_grads` points each parameter's `.grad` at its view of it (no copy, no allocation).

    Costs per element and step that the hot path avoids (measured on the CPU build): `zero()`
    writes nothing (a parameter's first gradient of the step is copied in, not added to a zeroed
    buffer, and a sum nobody wrote is zeroed only when read: `settle`), and a float32 gradient is
    widened into a kept scratch buffer before it is added to a float64 sum: torch's mixed-dtype
    `add_` measured about 20x slower than a copy plus a same-dtype add on an older build, and on
    torch 2.13 still up to 1.5x slower for a large parameter (1M elements; equal for tiny's).
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
        """(names, flat buffer of the sums) per partition group."""
        self.reduced: list[torch.Tensor] = []
        """Per partition group, the flat buffer of the step's reduced gradient (the parameters'
        dtype), written by the reduction (`elastic.parallel.grad_sync`)."""
        self._views: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        """Canonical name -> its reduced gradient (a view into its group's `reduced` buffer)."""
        self._group: dict[str, int] = {}
        multiples = [1] * len(groups) if pad is None else list(pad)
        assert len(multiples) == len(groups), "pad needs one multiple per partition group"
        widest = 0
        for names, multiple in zip(groups, multiples, strict=True):
            if not names:
                continue
            sizes = [params[n].numel() for n in names]
            length = -(-sum(sizes) // multiple) * multiple
            where = device or params[names[0]].device
            flat = torch.zeros(length, dtype=dtype, device=where)
            reduced = torch.zeros(length, dtype=params[names[0]].dtype, device=where)
            for n, view, grad in zip(names, flat[: sum(sizes)].split(sizes), reduced[: sum(sizes)].split(sizes),
                                     strict=True):
                self._views[n] = view.view(params[n].shape)
                self.grads[n] = grad.view(params[n].shape)
                self._group[n] = len(self.flats)
            self.flats.append((tuple(names), flat))
            self.reduced.append(reduced)
            widest = max(widest, *sizes)
        self._fresh: set[str] = set()
        """Sums that are zero by `zero()` but not written since (their memory holds old values).
        One set for the accumulator's life: the hooks hold it."""
        self._wide = torch.empty(widest if dtype == torch.float64 else 0, dtype=dtype,
                                 device=device or (self.named[0][1].device if self.named else None))
        """Scratch for widening one gradient to `dtype` before it is added (see the class doc):
        as long as the largest parameter to widen, each such parameter's hook holds its own view
        of it (`attach` grows it if a module's parameters need more)."""
        self._copies: list[torch.Tensor] | None = None
        self.listener: Callable[[str], None] | None = None
        """Called with a parameter's name after each gradient added (None: nobody listens)."""
        self.scratch: dict[tuple[int, str, int], torch.Tensor] = {}
        """Work buffers of the bucket reducer, kept across steps: (group, purpose, peer) -> buffer
        (allocating megabytes anew each step costs page faults on every step)."""
        self._handles: list[RemovableHandle] = []
        if attach:
            self.attach(module)

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """Canonical name -> its sum (a view into its group's flat buffer)."""
        self.settle()
        return self._views

    def attach(self, module: torch.nn.Module) -> None:
        """Sum the gradients of `module`'s parameters (the names and shapes allocated for)."""
        named = sorted(module.named_parameters(), key=lambda kv: kv[0])
        if [(n, tuple(p.shape)) for n, p in named] != [(n, tuple(self._views[n].shape)) for n, _ in self.named]:
            raise ValueError("the module's parameters are not the ones these buffers were allocated for")
        self.remove()
        self.named = named
        widen = [p.numel() for _, p in named if p.dtype != self.dtype]
        if widen and self._wide.numel() < max(widen):
            self._wide = torch.empty(max(widen), dtype=self.dtype, device=self._wide.device)
        for name, p in self.named:
            self._handles.append(p.register_post_accumulate_grad_hook(self._hook(name, p.dtype)))

    def _hook(self, name: str, grad_dtype: torch.dtype) -> Callable[[torch.Tensor], None]:
        """The hook moving `name`'s gradient into its sum. It runs once per parameter and
        microbatch on the backward's thread, so what does not change is looked up here, once:
        the sum, its view of the widening scratch, the set of fresh sums."""
        buf = self._views[name]
        fresh = self._fresh
        wide = None if grad_dtype == buf.dtype else self._wide[: buf.numel()].view(buf.shape)

        def move(p: torch.Tensor) -> None:
            g = p.grad
            assert g is not None
            if name in fresh:
                buf.copy_(g)
                fresh.discard(name)
            elif wide is None:
                buf.add_(g)
            else:
                wide.copy_(g)
                buf.add_(wide)
            p.grad = None
            if self.listener is not None:
                self.listener(name)

        return move

    def zero(self) -> None:
        """Make every sum zero (lazily: see the class doc)."""
        self._fresh.update(self._views)

    def settle(self, group: int | None = None) -> None:
        """Write the zeros of the sums not written since `zero()` (of one partition group, or
        all): before anything reads the flat buffers."""
        if not self._fresh:
            return
        names = self._fresh if group is None else self._fresh & set(self.flats[group][0])
        for name in list(names):
            self._views[name].zero_()
            self._fresh.discard(name)

    def group_of(self, name: str) -> int:
        """Index of the partition group holding `name`."""
        return self._group[name]

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of every sum, by canonical name, in buffers of its own (allocated on the
        first call and reused: the copy of the previous call is overwritten)."""
        self.settle()
        if self._copies is None:
            self._copies = [torch.empty_like(flat) for _, flat in self.flats]
        out: dict[str, torch.Tensor] = {}
        for (names, flat), copy in zip(self.flats, self._copies, strict=True):
            copy.copy_(flat)
            sizes = [self._views[n].numel() for n in names]
            for n, view in zip(names, copy[: sum(sizes)].split(sizes), strict=True):
                out[n] = view.view(self._views[n].shape)
        return out

    def add(self, sums: dict[str, torch.Tensor]) -> None:
        """Add gradient sums kept from elsewhere (same names, shapes and dtype) into the buffers."""
        unknown = sorted(set(sums) - set(self._views))
        if unknown:
            raise ValueError(f"kept gradient sums for parameters not in this stage: {unknown[:3]}")
        self.settle()
        for name, t in sums.items():
            self._views[name].add_(t.to(self._views[name].device))

    def write_grads(self) -> None:
        """Point each parameter's `.grad` at its reduced gradient for the optimizer."""
        for name, p in self.named:
            p.grad = self.grads[name]

    def remove(self) -> None:
        """Detach the hooks from the module (the accumulator is no longer used)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
