"""The step's summation tree as the memory model counts it (`parallel/blocks.py`, mirrored
torch-free): a holder's microbatches as the fewest aligned blocks, the scratch levels a block's
tree-order accumulation climbs, and the scratch buffers a combine of blocks needs. The array form
of an even split, every holder at once, is `split_blocks.py`."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence

Block = tuple[int, int]
"""(start, size): an aligned block of the step's summation tree (`parallel/blocks.py`)."""


def tree_blocks(start: int, count: int) -> tuple[Block, ...]:
    """The blocks of microbatches [start, start + count): the fewest aligned ones (`decompose`)."""
    out: list[Block] = []
    end = start + count
    while start < end:
        size = 1
        while start % (2 * size) == 0 and start + 2 * size <= end:
            size *= 2
        out.append((start, size))
        start += size
    return tuple(out)


def tree_levels(blocks: Sequence[Block]) -> int:
    """Scratch levels the tree-order accumulation of `blocks` climbs (a block of 2^k: k - 1)."""
    return max((max(0, size.bit_length() - 2) for _, size in blocks), default=0)


def combine_scratch(blocks: Sequence[Block]) -> int:
    """Scratch buffers the tree-order combine of `blocks` needs (`CombineProgram.scratch`): one
    per addition of two inputs; an addition with a scratch operand writes into it. Remembered
    per multiset of blocks: every holder of a plan's layers combines the same blocks, and the
    planner asks once per holder (`planner_figures`)."""
    return _combine_scratch(tuple(sorted(blocks)))


@functools.lru_cache(maxsize=64)  # the planner asks for one plan's blocks in a row
def _combine_scratch(blocks: tuple[Block, ...]) -> int:
    if all(a[0] + a[1] <= b[0] for a, b in zip(blocks, blocks[1:], strict=False)):
        return disjoint_scratch(blocks)
    return tree_scratch(blocks)


def disjoint_scratch(blocks: tuple[Block, ...]) -> int:
    """`combine_scratch` of disjoint aligned blocks in order (every plan's step), in one pass. The
    combine adds two inputs only at a node whose halves each hold one block and nothing else: the
    smallest aligned range over two neighbours, when it holds no third block (the blocks a node
    holds are consecutive)."""
    made = 0
    for i in range(len(blocks) - 1):
        (s1, _), (s2, z2) = blocks[i], blocks[i + 1]
        k = (s1 ^ (s2 + z2 - 1)).bit_length()
        lo, hi = (s1 >> k) << k, ((s1 >> k) + 1) << k
        left_alone = i == 0 or blocks[i - 1][0] < lo
        right_alone = i + 2 >= len(blocks) or blocks[i + 2][0] + blocks[i + 2][1] > hi
        made += left_alone and right_alone
    return made


def tree_scratch(blocks: tuple[Block, ...]) -> int:
    """`combine_scratch` by walking the tree (any blocks, repeated or nested)."""
    count = Counter(blocks)
    unique = sorted(count)
    end = max(start + size for start, size in unique)
    top = 1
    while top < end:
        top *= 2
    made = 0

    def node(start: int, size: int, inside: list[Block]) -> bool | None:
        """Whether the subtree's sum is a scratch (True) or an input (False); None: empty."""
        nonlocal made
        inside = [b for b in inside if start <= b[0] and b[0] + b[1] <= start + size]
        if not inside:
            return None
        refs: list[bool] = [False] * count.get((start, size), 0)
        if any(b[1] < size for b in inside):
            half = size // 2
            refs += [c for c in (node(start, half, inside), node(start + half, half, inside)) if c is not None]
        acc = refs[0]
        for ref in refs[1:]:
            made += not (acc or ref)
            acc = True
        return acc

    node(0, top, unique)
    return made
