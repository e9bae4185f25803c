"""Which worker of a group sends which shard to which: `ShardMove`, and `assign_moves`, which
picks a sender for every shard a receiver lacks. Imports no torch: the leader plans a generation's
moves (elastic/parallel/shard_moves.py) without paying for it; the exchange that carries them out
is elastic/transfer/collective.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elastic.transfer.shards import ShardKey


@dataclass(frozen=True, kw_only=True)
class ShardMove:
    """One shard sent from one worker of the group to another."""

    key: ShardKey
    """The shard."""
    src: int
    """Group rank of the worker that sends it (a holder)."""
    dst: int
    """Group rank of the worker that receives it."""


def assign_moves(
    needs: Mapping[int, Sequence[ShardKey]], holders: Mapping[ShardKey, Sequence[int]]
) -> list[ShardMove]:
    """Pick a sender for every (shard, receiver) pair in `needs`, spreading load over holders.

    `needs`: receiver rank -> shards it must receive; `holders`: shard -> ranks that hold it.
    (shard, receiver) pairs are placed fewest-candidates-first (then by shard, receiver), each
    on the candidate that sends fewest shards so far (ties: lowest rank). A receiver is never
    its own sender; a pair with no other holder is left out (the caller fetches it another
    way). The result depends only on the contents, not on dict or list order, so every worker
    computes the same list; it is sorted by (src, dst, key).
    """
    held: dict[ShardKey, set[int]] = {}
    for key, ranks in holders.items():
        held.setdefault(ShardKey(*key), set()).update(ranks)
    wanted = sorted({(ShardKey(*key), dst) for dst, keys in needs.items() for key in keys})
    candidates = {(key, dst): sorted(held.get(key, set()) - {dst}) for key, dst in wanted}
    load: dict[int, int] = {}
    moves: list[ShardMove] = []
    for key, dst in sorted(wanted, key=lambda kd: (len(candidates[kd]), kd)):
        ranks = candidates[(key, dst)]
        if not ranks:
            continue
        src = min(ranks, key=lambda r: (load.get(r, 0), r))
        load[src] = load.get(src, 0) + 1
        moves.append(ShardMove(key=key, src=src, dst=dst))
    return sorted(moves, key=lambda m: (m.src, m.dst, m.key))
