"""The instantiation knapsack at cluster scale: cost independent of the node count.

When every cover of the N nodes already has enough pipelines (N >= need x the largest template)
and the microbatches can feed any pipeline count, the pipeline count drops out of the knapsack:
what is left is "the most microbatches a multiset of templates covering exactly v nodes can take
within the target time", an unbounded knapsack g(v) = max_n g(v - n) + cap_n.

Two things make it cheap:

- **Blocks.** g(v) reads only g(v - n) with n >= the smallest template size s_min, so the s_min
  values g(V .. V + s_min - 1) come from earlier ones in one vectorised step.
- **Periodicity.** Let n* be the template of the best microbatches per node (cap_n / n) at a
  target. Some optimal multiset has fewer than n* other templates: among any n* of them, some
  non-empty subset has a node count divisible by n* (pigeonhole on prefix sums modulo n*), and
  replacing it by copies of n* covers the same nodes and takes no fewer microbatches. So its
  other templates hold fewer than n* x s_max nodes, and for any r = N - k n* >= n* x s_max,
  g(N) = g(r) + k cap_{n*}. The table stops at about s_max x (s_max + 1) nodes, whatever N is.

All targets of one call share the table (one column each); each has its own n*.
"""

from __future__ import annotations

import numpy as np

_NONE = np.int64(-(1 << 40))
"""g(v) when no multiset covers exactly v nodes (far below any sum of caps)."""


class FlatKnapsack:
    """g over node counts for several targets at once, extrapolated to `num_nodes`."""

    def __init__(self, sizes: np.ndarray, caps: np.ndarray, num_nodes: int, need: int) -> None:
        """`sizes`: template node counts (ascending); `caps[t, q]`: microbatches template t takes
        within target q (0: not usable); `need`: pipelines required, which every cover of
        `num_nodes` nodes must already reach (num_nodes >= need x max(sizes))."""
        assert num_nodes >= need * int(sizes.max()), "pipeline counts would matter"
        self.sizes = sizes
        self.num_nodes = num_nodes
        value = np.where(caps >= 1, caps, _NONE)  # (templates, Q)
        density = np.where(caps >= 1, caps / sizes[:, None], -1.0)
        self.star = density.argmax(axis=0)  # n*'s index per target
        q_all = np.arange(caps.shape[1])
        self.usable = density[self.star, q_all] > 0
        star_size = sizes[self.star]
        s_max = int(sizes.max())
        low = np.maximum(star_size - 1, need) * s_max  # r >= low reads the periodic regime
        self.copies = np.where(num_nodes > low, (num_nodes - low) // star_size, 0)
        self.rest = num_nodes - self.copies * star_size  # r per target
        self.star_value = np.where(self.usable, caps[self.star, q_all], 0)
        top = int(self.rest.max())
        self.best, self.choice = _table(sizes, value, top)

    def values(self) -> np.ndarray:
        """g(num_nodes) per target; negative where no multiset covers the nodes."""
        q_all = np.arange(len(self.rest))
        got = self.best[self.rest, q_all]
        return np.where(self.usable & (got >= 0), got + self.copies * self.star_value, -1)

    def sizes_for(self, q: int) -> list[int]:
        """A multiset reaching values()[q] (which must be >= 0), as node counts."""
        v = int(self.rest[q])
        out = [int(self.sizes[self.star[q]])] * int(self.copies[q])
        while v > 0:
            t = int(self.choice[v, q])
            assert t >= 0, "unwinding an unreachable state"
            out.append(int(self.sizes[t]))
            v -= int(self.sizes[t])
        return out


def _table(sizes: np.ndarray, value: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """best[v, q] = g(v) for v in [0, top], and choice[v, q] the template index that reaches it."""
    q_count = value.shape[1]
    best = np.full((top + 1, q_count), _NONE, dtype=np.int64)
    choice = np.full((top + 1, q_count), -1, dtype=np.int64)
    best[0] = 0
    step = int(sizes.min())
    start = step  # g(1 .. s_min - 1) stay impossible
    while start <= top:
        block = np.arange(start, min(start + step, top + 1))  # each v reads v - n < start
        src = block[None, :] - sizes[:, None]  # (templates, B)
        ok = src >= 0
        prev = best[np.where(ok, src, 0)]  # (templates, B, Q)
        cand = np.where(ok[:, :, None] & (prev > _NONE), prev + value[:, None, :], _NONE)
        pick = cand.argmax(axis=0)  # (B, Q): the first (smallest) template among equals
        top_value = np.take_along_axis(cand, pick[None], axis=0)[0]
        reached = top_value > _NONE // 2
        best[block] = np.where(reached, top_value, _NONE)
        choice[block] = np.where(reached, pick, -1)
        start += step
    return best, choice
