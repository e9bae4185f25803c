"""Gradient accumulation in tree order: one sum per parameter and block of the step.

Autograd writes each microbatch's gradient into `param.grad`; a post-accumulate hook moves it
into the sums and clears `param.grad`. The step's blocks (`elastic.parallel.blocks`) are the
aligned subtrees of the summation tree this worker computes; before each backward the caller
names its global microbatch (`leaf`), and the hook adds the gradient where the tree says: a
block's first two leaves are a copy and an add into the block's sum (DDP's work), a later
left leaf waits in a per-level scratch until its right sibling arrives, as in a binary
counter. So a block's sum is the same bits whoever computes it, in any plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from elastic.parallel.blocks import Block


class GradAccumulator:
    """Per-parameter, per-block gradient sums of one step, in `dtype`, packed in flat buffers,
    and the step's reduced gradient beside them.

    `partition` groups parameter names (every parameter exactly once); each group's sums of a
    block are views into one contiguous buffer, so a gradient bucket's block is sent, measured
    and zeroed with one operation each and no copies. Default: one group per parameter, in name
    order. `pad`: per group, a multiple its flat buffers' length is rounded up to (zeros after
    the views; a reduce-scatter over that many workers splits it evenly). `listener`, when set,
    is called with a parameter's name right after its gradient was added (the bucket reducer
    launches a bucket's reduction once the last backward added all of its gradients).

    Each group also has a `reduced` flat buffer in the parameters' dtype: the cross-pipeline
    reduction writes the step's gradient there (never into the sums, which stay this worker's
    own until the next step, so a step abandoned mid-reduction still has them for partial
    replay), and `write_grads` points each parameter's `.grad` at its view of it.

    Costs the hot path avoids: `begin`/`zero` write nothing (a block's first gradient is copied
    in, and a sum nobody wrote is zeroed only when read: `settle`); a gradient narrower than the
    sums is widened into a kept scratch buffer before it is added (torch's mixed-dtype `add_` is
    slower than a copy plus a same-dtype add).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        dtype: torch.dtype = torch.float32,
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
        self.flats: list[tuple[tuple[str, ...], list[torch.Tensor]]] = []
        """(names, one flat buffer of sums per block slot) per partition group."""
        self.reduced: list[torch.Tensor] = []
        """Per partition group, the flat buffer of the step's reduced gradient (the parameters'
        dtype), written by the reduction (`elastic.parallel.bucket_reducer`)."""
        self._views: dict[str, list[torch.Tensor]] = {}
        """Name -> its sum in each block slot (lists grow in place: the hooks hold them)."""
        self._next: dict[str, list[int]] = {}
        """Name -> per block slot, the next leaf offset its sum expects (0: nothing written;
        the block's size: complete)."""
        self._stacks: dict[str, list[torch.Tensor]] = {}
        """Name -> per tree level, a scratch sum of a left subtree waiting for its sibling."""
        self._sizes: list[list[int]] = []
        self.grads: dict[str, torch.Tensor] = {}
        """Canonical name -> its reduced gradient (a view into its group's `reduced` buffer)."""
        self._group: dict[str, int] = {}
        self._shapes = {n: params[n].shape for n in params}
        multiples = [1] * len(groups) if pad is None else list(pad)
        assert len(multiples) == len(groups), "pad needs one multiple per partition group"
        self._device = device
        for names, multiple in zip(groups, multiples, strict=True):
            if not names:
                continue
            sizes = [params[n].numel() for n in names]
            length = -(-sum(sizes) // multiple) * multiple
            where = device or params[names[0]].device
            reduced = torch.zeros(length, dtype=params[names[0]].dtype, device=where)
            for n, grad in zip(names, reduced[: sum(sizes)].split(sizes), strict=True):
                self.grads[n] = grad.view(params[n].shape)
                self._group[n] = len(self.flats)
                self._views[n], self._next[n] = [], []
            self.flats.append((tuple(names), []))
            self._sizes.append(sizes)
            self.reduced.append(reduced)
        self.blocks: tuple[Block, ...] = ()
        """The step's blocks, ascending (`begin`); slot i holds the sums of `blocks[i]`."""
        self._slot_of: dict[int, tuple[int, int]] = {}
        self._cur: tuple[int, int] | None = None
        self._grow(1)
        widest = max((p.numel() for _, p in self.named if p.dtype != dtype), default=0)
        self._wide = torch.empty(widest, dtype=dtype, device=self._where())
        """Scratch for widening one gradient to `dtype` before it is added (see the class doc)."""
        self._copies: list[list[torch.Tensor]] = []
        self.listener: Callable[[str], None] | None = None
        """Called with a parameter's name after each gradient added (None: nobody listens)."""
        self.scratch: dict[tuple[int, str, int], torch.Tensor] = {}
        """Work buffers of the bucket reducer, kept across steps: (group, purpose, index) -> buffer
        (allocating megabytes anew each step costs page faults on every step)."""
        self._handles: list[RemovableHandle] = []
        if attach:
            self.attach(module)

    def _where(self) -> torch.device | None:
        return self._device or (self.named[0][1].device if self.named else None)

    def _grow(self, slots: int) -> None:
        """Allocate flat buffers (zeros) up to `slots` block slots per group."""
        for (names, flats), sizes, reduced in zip(self.flats, self._sizes, self.reduced, strict=True):
            while len(flats) < slots:
                flat = torch.zeros(reduced.numel(), dtype=self.dtype, device=self._device or reduced.device)
                for n, view in zip(names, flat[: sum(sizes)].split(sizes), strict=True):
                    self._views[n].append(view.view(self._shapes[n]))
                    self._next[n].append(0)
                flats.append(flat)

    def attach(self, module: torch.nn.Module) -> None:
        """Sum the gradients of `module`'s parameters (the names and shapes allocated for)."""
        named = sorted(module.named_parameters(), key=lambda kv: kv[0])
        if [(n, tuple(p.shape)) for n, p in named] != [(n, tuple(self._shapes[n])) for n, _ in self.named]:
            raise ValueError("the module's parameters are not the ones these buffers were allocated for")
        self.remove()
        self.named = named
        widen = [p.numel() for _, p in named if p.dtype != self.dtype]
        if widen and self._wide.numel() < max(widen):
            self._wide = torch.empty(max(widen), dtype=self.dtype, device=self._wide.device)
        for name, p in self.named:
            self._handles.append(p.register_post_accumulate_grad_hook(self._hook(name, p.dtype)))

    def begin(self, blocks: Sequence[Block]) -> None:
        """Start a step whose sums are those of `blocks` (aligned, disjoint); every sum is zero."""
        ordered = tuple(sorted(blocks))
        for a, b in zip(ordered, ordered[1:], strict=False):
            if a.end > b.start:
                raise ValueError(f"blocks {a} and {b} overlap")
        for b in ordered:
            if not b.aligned:
                raise ValueError(f"{b} is not an aligned block (a power-of-two size at a multiple of it)")
        self._grow(len(ordered))
        self.blocks = ordered
        self._slot_of = {b.start + k: (slot, k) for slot, b in enumerate(ordered) for k in range(b.size)}
        self.zero()

    def leaf(self, microbatch: int) -> None:
        """The global microbatch whose gradients the next backward adds."""
        try:
            self._cur = self._slot_of[microbatch]
        except KeyError:
            raise ValueError(f"microbatch {microbatch} is in none of this step's blocks {list(self.blocks)}") from None

    def _hook(self, name: str, grad_dtype: torch.dtype) -> Callable[[torch.Tensor], None]:
        """The hook moving `name`'s gradient into its sums. It runs once per parameter and
        microbatch on the backward's thread, so what does not change is looked up here, once."""
        state = self._next[name]
        numel = self._shapes[name].numel()
        narrow = grad_dtype != self.dtype

        def move(p: torch.Tensor) -> None:
            g = p.grad
            assert g is not None
            cur = self._cur
            if cur is None:
                raise RuntimeError("a gradient arrived before the accumulator was told its microbatch (leaf)")
            slot, k = cur
            if state[slot] != k:
                self._skip(name, slot, k)
            if narrow:
                wide = self._wide[:numel].view(g.shape)
                wide.copy_(g)
                g = wide
            self._feed(name, slot, k, g)
            p.grad = None
            if self.listener is not None:
                self.listener(name)

        return move

    def _feed(self, name: str, slot: int, k: int, g: torch.Tensor) -> None:
        """Add `g` as leaf `k` of the block in slot `slot`: the block's first two leaves are a
        copy and an add into its sum, later ones climb the tree (`_climb`)."""
        if k == 0:
            self._views[name][slot].copy_(g)
        elif k == 1:
            self._views[name][slot].add_(g)
        else:
            self._climb(name, slot, k, g)
        self._next[name][slot] = k + 1

    def _climb(self, name: str, slot: int, k: int, g: torch.Tensor) -> None:
        """Add leaf `k` (>= 2) of the block in slot `slot`: a right child merges into its left
        sibling (the block's sum when that sibling starts the block, else the level's scratch)
        and climbs; a left child waits in its level's scratch."""
        flat = self._views[name][slot]
        stack = self._stacks.setdefault(name, [])
        cur: torch.Tensor = g
        level = 0
        while (k >> level) & 1:
            left_start = ((k >> level) - 1) << level
            left = flat if left_start == 0 else self._level(stack, level, flat)
            left.add_(cur)
            if left is flat:
                return
            cur = left
            level += 1
        home = self._level(stack, level, flat)
        if level == 0:
            home.copy_(cur)
        else:  # cur is the scratch of the level below, now free: swap it in
            stack[level - 1], stack[level] = stack[level], stack[level - 1]

    @staticmethod
    def _level(stack: list[torch.Tensor], level: int, like: torch.Tensor) -> torch.Tensor:
        while len(stack) <= level:
            stack.append(torch.empty_like(like))
        return stack[level]

    def _skip(self, name: str, slot: int, k: int) -> None:
        """`name` had no gradient in the block's leaves from the next expected one up to, not
        including, `k`: they count as zeros."""
        done = self._next[name][slot]
        if done > k:
            raise RuntimeError(f"{name}: a second gradient for leaf {k} of block {self.blocks[slot]}")
        zeros = torch.zeros_like(self._views[name][slot])
        for j in range(done, k):
            self._feed(name, slot, j, zeros)

    def zero(self) -> None:
        """Make every sum zero (lazily: see the class doc)."""
        for state in self._next.values():
            for slot in range(len(state)):
                state[slot] = 0
        self._cur = None

    def settle(self, group: int | None = None) -> None:
        """Complete the sums of one partition group (or all) before anything reads them: a sum
        nobody wrote is zeroed, one whose last leaves had no gradient gets them as zeros."""
        names = [n for names, _ in self.flats for n in names] if group is None else self.flats[group][0]
        for name in names:
            state = self._next[name]
            for slot, block in enumerate(self.blocks):
                if state[slot] == 0:
                    self._views[name][slot].zero_()
                    state[slot] = block.size
                elif state[slot] < block.size:
                    self._skip(name, slot, block.size)

    def sums(self, group: int) -> list[torch.Tensor]:
        """The flat buffers of group `group`'s sums, one per block of the step (settled)."""
        self.settle(group)
        return self.flats[group][1][: len(self.blocks)]

    def group_of(self, name: str) -> int:
        """Index of the partition group holding `name`."""
        return self._group[name]

    def block_sums(self) -> dict[Block, dict[str, torch.Tensor]]:
        """Block -> canonical name -> its sum (views of the buffers, settled; no copy)."""
        self.settle()
        return {b: {n: views[slot] for n, views in self._views.items()} for slot, b in enumerate(self.blocks)}

    def snapshot(self) -> dict[Block, dict[str, torch.Tensor]]:
        """A copy of every sum, by block and canonical name, in buffers of its own (allocated on
        the first call and reused: the copy of the previous call is overwritten)."""
        self.settle()
        out: dict[Block, dict[str, torch.Tensor]] = {}
        for slot, b in enumerate(self.blocks):
            while len(self._copies) <= slot:
                self._copies.append([torch.empty_like(flats[0]) for _, flats in self.flats])
            kept: dict[str, torch.Tensor] = {}
            for (names, flats), copy, sizes in zip(self.flats, self._copies[slot], self._sizes, strict=True):
                copy.copy_(flats[slot])
                for n, view in zip(names, copy[: sum(sizes)].split(sizes), strict=True):
                    kept[n] = view.view(self._shapes[n])
            out[b] = kept
        return out

    def add(self, block: Block, sums: dict[str, torch.Tensor]) -> None:
        """Take sums of `block` kept from elsewhere (same names, shapes and dtype) as this step's
        sums of that block (a block of the step nothing was added to yet)."""
        unknown = sorted(set(sums) - set(self._views))
        if unknown:
            raise ValueError(f"kept gradient sums for parameters not in this stage: {unknown[:3]}")
        if block not in self.blocks:
            raise ValueError(f"kept sums of {block}, which is not a block of this step {list(self.blocks)}")
        slot = self.blocks.index(block)
        for name, t in sums.items():
            if self._next[name][slot] != 0:
                raise ValueError(f"{name}: block {block} already has sums in this step")
            self._views[name][slot].copy_(t.to(self._views[name][slot].device))
            self._next[name][slot] = block.size

    def write_grads(self) -> None:
        """Point each parameter's `.grad` at its reduced gradient for the optimizer."""
        for name, p in self.named:
            p.grad = self.grads[name]

    def remove(self) -> None:
        """Detach the hooks from the module (the accumulator is no longer used)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
