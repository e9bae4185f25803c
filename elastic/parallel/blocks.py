"""The step's summation tree: one fixed pairwise float32 sum over the global batch's microbatches.

A step's gradient is the sum of its M microbatches' gradients. Float32 addition is not
associative, so a sum that follows how the plan splits the microbatches (which pipeline adds
which, in which order) changes its last bits when the plan changes, and AdamW magnifies them.
So every plan computes one sum: the pairwise tree over the microbatch indices 0 .. M-1 (the
leaves of a complete binary tree of the next power of two, absent leaves skipped: a node with
one present child is that child). Its value is a function of the microbatches only.

A worker holds *blocks*: aligned subtrees (start a multiple of size, size a power of two) of
the microbatches it computed (`decompose`), each summed in tree order as the gradients arrive
(`GradAccumulator`). The cross-pipeline reduction sends each block's float32 sums, and a holder
combines every holder's blocks in tree order (`combine`): with one aligned block per pipeline
(a power-of-two share at an aligned offset) that is the bytes of DDP's float32 all-reduce.
Since IEEE addition is commutative, only the tree's shape matters, not which operand is left.

Blocks may come zero-filled for some elements (a worker that holds a block's sums for some of
a bucket's layers only, in a replayed step): for every element the nonzero blocks still
partition the microbatches, and adding a zero changes no value.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch


class Block(NamedTuple):
    """Microbatches [start, start + size) of a step: an aligned subtree of its summation tree."""

    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def aligned(self) -> bool:
        """A power-of-two size at a multiple of it: a subtree of the summation tree."""
        return self.size >= 1 and self.size & (self.size - 1) == 0 and self.start % self.size == 0


def decompose(microbatches: Iterable[int]) -> tuple[Block, ...]:
    """The fewest aligned blocks covering exactly `microbatches` (distinct indices), ascending."""
    ordered = sorted(set(microbatches))
    if ordered and ordered[0] < 0:
        raise ValueError(f"microbatch indices must be >= 0, got {ordered[0]}")
    out: list[Block] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        start, end = ordered[i], ordered[j] + 1
        while start < end:
            size = 1
            while (start % (2 * size) == 0) and start + 2 * size <= end:
                size *= 2
            out.append(Block(start, size))
            start += size
        i = j + 1
    return tuple(out)


Ref = tuple[bool, int]
"""An operand of a combine program: (True, scratch index) or (False, input index)."""


class CombineProgram:
    """The additions that combine a set of blocks (with repeats) in tree order, fixed once for
    a block list: `ops` are (scratch index written, operand, operand), `root` the result."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        if not blocks:
            raise ValueError("nothing to combine")
        by_block: dict[Block, list[int]] = {}
        for i, b in enumerate(blocks):
            if not b.aligned:
                raise ValueError(f"{b} is not an aligned block")
            by_block.setdefault(b, []).append(i)
        self.ops: list[tuple[int, Ref, Ref]] = []
        self.scratch = 0
        top = 1
        while top < max(b.end for b in blocks):
            top *= 2
        starts = sorted(by_block)
        root = self._node(0, top, by_block, starts)
        assert root is not None
        self.root: Ref = root

    def _node(self, start: int, size: int, by_block: dict[Block, list[int]], blocks: list[Block]) -> Ref | None:
        inside = [b for b in blocks if start <= b.start and b.end <= start + size]
        if not inside:
            return None
        refs: list[Ref] = [(False, i) for i in by_block.get(Block(start, size), [])]
        if any(b.size < size for b in inside):
            half = size // 2
            for child in (self._node(start, half, by_block, inside), self._node(start + half, half, by_block, inside)):
                if child is not None:
                    refs.append(child)
        acc = refs[0]
        for ref in refs[1:]:
            dst = acc[1] if acc[0] else ref[1] if ref[0] else self._new()
            self.ops.append((dst, acc, ref))
            acc = (True, dst)
        return acc

    def _new(self) -> int:
        self.scratch += 1
        return self.scratch - 1


def combine(
    blocks: Sequence[Block], parts: Sequence[torch.Tensor], out: torch.Tensor, scratch: Sequence[torch.Tensor],
    *, program: CombineProgram | None = None, norm: torch.Tensor | None = None, wide: torch.Tensor | None = None,
) -> None:
    """Write the tree-order sum of `parts` (part i holds the sums of `blocks[i]`; all as long as
    `out`) into `out`, chunk by chunk: each scratch buffer (at least `program.scratch` of them,
    of the parts' dtype) is one chunk long. `norm` (0-dim float64), when given, gets the sum of
    squares of `out`'s values, measured through the float64 chunk buffer `wide` (None: by a
    float64 norm kernel, the accelerator's way)."""
    program = program or CombineProgram(blocks)
    if len(scratch) < program.scratch:
        raise ValueError(f"combining {list(blocks)} needs {program.scratch} scratch buffers, got {len(scratch)}")
    if norm is not None:
        norm.zero_()
    n = out.numel()
    step = scratch[0].numel() if scratch else n
    if wide is not None:
        step = min(step, wide.numel())
    for begin in range(0, n, max(step, 1)):
        end = min(begin + step, n)
        tmp = [s[: end - begin] for s in scratch]

        def view(ref: Ref, tmp: list[torch.Tensor] = tmp, begin: int = begin, end: int = end) -> torch.Tensor:
            return tmp[ref[1]] if ref[0] else parts[ref[1]][begin:end]

        chunk = out[begin:end]
        last = len(program.ops) - 1
        for k, (dst, a, b) in enumerate(program.ops):
            into = chunk if k == last and chunk.dtype == tmp[dst].dtype else tmp[dst]
            torch.add(view(a), view(b), out=into)
        if not program.ops or chunk.dtype != parts[0].dtype:
            chunk.copy_(view(program.root))
        if norm is not None and wide is None:
            norm.add_(torch.linalg.vector_norm(chunk, dtype=torch.float64).square())
        elif norm is not None:
            assert wide is not None
            w = wide[: end - begin]
            w.copy_(chunk)
            norm.add_(torch.dot(w, w))


def sum_of_squares(t: torch.Tensor, wide: torch.Tensor | None) -> torch.Tensor:
    """The sum of `t`'s squared elements accumulated in float64, one chunk at a time through the
    float64 scratch `wide`: no full-size temporary (whose page faults cost more than the sum),
    and unlike a float32 dot product no float32 accumulator. Without `wide` (an accelerator):
    one float64 norm over the whole tensor, one kernel."""
    if wide is None:
        return torch.linalg.vector_norm(t, dtype=torch.float64).square()
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for chunk in t.reshape(-1).split(wide.numel()):
        w = wide[: chunk.numel()]
        w.copy_(chunk)
        total += torch.dot(w, w)
    return total
