"""Shard identity and the spreading of wanted shards over the holders that can serve them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple


class ShardKey(NamedTuple):
    """One tensor-parallel shard of one planning layer (equal to the plain tuple `(layer, tp_rank)`)."""

    layer: int
    tp_rank: int


def assign_shards(candidates: Mapping[ShardKey, Sequence[str]]) -> dict[str, list[ShardKey]]:
    """Spread shards over holders: each shard goes to one of its candidate holders.

    Shards with the fewest candidates are placed first, each on the candidate with the fewest
    shards so far (ties broken by the candidate's position in its list), so load is balanced
    wherever the holdings allow and the result is deterministic. Every shard needs at least
    one candidate (ValueError otherwise). Returns holder -> its shards, in shard order.
    """
    empty = sorted(k for k, c in candidates.items() if not c)
    if empty:
        raise ValueError(f"no holder to fetch shards {[tuple(k) for k in empty]} from")
    load: dict[str, int] = {}
    plan: dict[str, list[ShardKey]] = {}
    for key in sorted(candidates, key=lambda k: (len(candidates[k]), k)):
        holders = candidates[key]
        best = min(range(len(holders)), key=lambda i: (load.get(holders[i], 0), i))
        holder = holders[best]
        load[holder] = load.get(holder, 0) + 1
        plan.setdefault(holder, []).append(key)
    return {holder: sorted(keys) for holder, keys in plan.items()}
