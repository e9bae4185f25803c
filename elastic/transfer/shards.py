"""Shard identity and the spreading of wanted shards over the holders that can serve them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple


class ShardKey(NamedTuple):
    """One tensor-parallel shard of one planning layer: the one key of a shard everywhere (the
    trainer, checkpoints, both transfer paths). Equal to, hashes like and prints as the plain
    tuple `(layer, tp_rank)`, so messages and JSON read the same as with plain tuples."""

    layer: int
    tp_rank: int

    def __repr__(self) -> str:
        return f"({self.layer}, {self.tp_rank})"


FetchAssignment = dict[str, list[ShardKey]]
"""Which shard is fetched from which holder in one round: holder address -> its shards (one
Fetch call each), in shard order."""


def assign_shards(candidates: Mapping[ShardKey, Sequence[str]]) -> FetchAssignment:
    """Spread shards over holders: each shard goes to one of its candidate holders.

    Shards with the fewest candidates are placed first, each on the candidate with the fewest
    shards so far (ties broken by the candidate's position in its list), so load is balanced
    wherever the holdings allow and the result is deterministic. Every shard needs at least
    one candidate (ValueError otherwise).
    """
    empty = sorted(k for k, c in candidates.items() if not c)
    if empty:
        raise ValueError(f"no holder to fetch shards {[tuple(k) for k in empty]} from")
    load: dict[str, int] = {}
    assignment: FetchAssignment = {}
    for key in sorted(candidates, key=lambda k: (len(candidates[k]), k)):
        holders = candidates[key]
        best = min(range(len(holders)), key=lambda i: (load.get(holders[i], 0), i))
        holder = holders[best]
        load[holder] = load.get(holder, 0) + 1
        assignment.setdefault(holder, []).append(key)
    return {holder: sorted(keys) for holder, keys in assignment.items()}
