"""The summation-tree blocks of an even split of a step, for every holder at once (numpy).

`sum_tree.tree_blocks` decomposes one holder's microbatches [s, e) into the fewest aligned
blocks: from s, the largest power of two that s is a multiple of and that fits before e. Here
every holder of a split advances together, one block per round (at most 2 log2 M rounds), so a
split of P pipelines costs a few dozen array operations instead of P Python loops. The planner's
memory figures (`planner_figures.planner_figures`) ask this of every pipeline count up to the node
count: at 2,048 nodes the Python loops took about 11 s, most of a leader's start.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True)
class SplitBlocks:
    """Every block of an even split of `microbatches` over `pipelines` holders, in start order."""

    pipelines: int
    starts: np.ndarray
    """Each block's first microbatch (ascending)."""
    sizes: np.ndarray
    """Each block's microbatches (a power of two)."""
    per_holder: np.ndarray
    """Blocks of each holder, in plan order."""
    levels: np.ndarray
    """`sum_tree.tree_levels` of each holder's blocks."""

    def kinds(self) -> list[tuple[int, int]]:
        """The distinct (blocks, levels) of the holders."""
        keys = np.unique(self.per_holder * 64 + self.levels)  # levels < 63: bit lengths of int64
        return [(int(k) // 64, int(k) % 64) for k in keys]

    def scratch(self) -> int:
        """`sum_tree.disjoint_scratch` of all the blocks: a pair of neighbours makes a scratch
        buffer when the smallest aligned range over both holds no third block."""
        s, z = self.starts, self.sizes
        if len(s) < 2:
            return 0
        k = bit_length(s[:-1] ^ (s[1:] + z[1:] - 1))
        lo = (s[:-1] >> k) << k
        hi = lo + (np.int64(1) << k)
        before = np.concatenate([[-1], s[:-2]])  # the block before each pair, -1: none
        left_alone = (np.arange(len(s) - 1) == 0) | (before < lo)
        after_end = np.concatenate([s[2:] + z[2:], [np.iinfo(np.int64).max]])  # the block after each pair
        right_alone = (np.arange(len(s) - 1) + 2 >= len(s)) | (after_end > hi)
        return int(np.count_nonzero(left_alone & right_alone))


def bit_length(x: np.ndarray) -> np.ndarray:
    """int.bit_length of each (non-negative, below 2^53) element."""
    _, exponent = np.frexp(x.astype(np.float64))
    return np.where(x > 0, exponent, 0).astype(np.int64)


def even_split_blocks(microbatches: int, pipelines: int) -> SplitBlocks:
    """The blocks of `microbatches` split over `pipelines` holders as evenly as they go, the
    first `microbatches % pipelines` holders one more (`GradShare.of_split`'s order)."""
    if not 1 <= pipelines <= microbatches:
        raise ValueError(f"{microbatches} microbatches over {pipelines} pipelines")
    holder = np.arange(pipelines, dtype=np.int64)
    base, extra = divmod(microbatches, pipelines)
    at = holder * base + np.minimum(holder, extra)
    end = at + base + (holder < extra)
    count = np.zeros(pipelines, dtype=np.int64)
    levels = np.zeros(pipelines, dtype=np.int64)
    starts, sizes = [], []
    active = holder
    while active.size:
        s, e = at[active], end[active]
        fits = np.int64(1) << (bit_length(e - s) - 1)  # the largest power of two up to e - s
        size = np.where(s > 0, np.minimum(s & -s, fits), fits)  # aligned: divides s
        starts.append(s)
        sizes.append(size)
        count[active] += 1
        levels[active] = np.maximum(levels[active], np.maximum(bit_length(size) - 2, 0))
        at[active] = s + size
        active = active[at[active] < end[active]]
    all_starts, all_sizes = np.concatenate(starts), np.concatenate(sizes)
    order = np.argsort(all_starts, kind="stable")
    return SplitBlocks(pipelines=pipelines, starts=all_starts[order], sizes=all_sizes[order],
                       per_holder=count, levels=levels)
