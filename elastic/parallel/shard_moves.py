"""The collective shard path's moves of a generation: which rank of its plan sends which layer
shard to which, planned once, by the leader, from the holdings it read when every report was in.

Each rank of a plan needs the shards of its stage's layers at its tensor-parallel rank; a rank
that lacks one receives it from another rank of the plan that holds it
(`elastic.transfer.moves.assign_moves` spreads the senders). The leader writes the result into
the generation record (`GenerationRecord.moves`, as `MoveRow`s), so a worker entering the
generation reads no holder map: before, each of W workers read every node's holdings and
registrations (1.1 MB at 2,048 nodes, O(W x nodes) bytes a change) and planned the same moves
itself. The rows grow with the shards that move, not with the workers; a shard no rank of the
plan holds is left out (fetched over gRPC from a holder outside the plan, or from a checkpoint).

Imports no torch (the leader's process stays light).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from elastic.parallel.layout import WorkerCoord, assign_ranks
from elastic.transfer.moves import ShardMove, assign_moves
from elastic.transfer.shards import ShardKey
from templates.plan import Plan

MoveRow = tuple[int, int, int, int]
"""One move as the generation record stores it: (layer, tp rank, sending rank, receiving rank)."""

WorkerHoldings = Mapping[tuple[int, int], Sequence[ShardKey]]
"""(node, local rank) -> the shards that worker holds (what `holdings/` says)."""


def ranked_holdings(
    plan: Plan, holdings: WorkerHoldings, *, workers: Sequence[WorkerCoord] | None = None
) -> dict[int, list[ShardKey]]:
    """Rank in `plan` -> the shards that worker holds; workers outside the plan are left out.
    `workers`: `assign_ranks(plan)`, if the caller has it (16,384 of them take 30 ms)."""
    ranks = {(w.node, w.local_rank): w.rank for w in workers or assign_ranks(plan)}
    return {ranks[worker]: list(held) for worker, held in holdings.items() if worker in ranks}


def plan_moves(
    plan: Plan, by_rank: Mapping[int, Sequence[ShardKey]], *, workers: Sequence[WorkerCoord] | None = None
) -> list[ShardMove]:
    """The moves that give every rank of `plan` the shards of its stage it lacks, from the ranks
    of `plan` that hold them (`by_rank`: rank -> shards held); sorted by (src, dst, key).
    `workers`: as in `ranked_holdings`."""
    needs: dict[int, list[ShardKey]] = {}
    for w in workers or assign_ranks(plan):
        have = set(by_rank.get(w.rank, ()))  # a ShardKey is equal to its plain tuple
        want = [ShardKey(layer, w.tp_rank) for layer in plan.pipelines[w.pipeline].stages[w.stage].held if (layer, w.tp_rank) not in have]
        if want:
            needs[w.rank] = want
    wanted = {k for keys in needs.values() for k in keys}
    holders: dict[ShardKey, list[int]] = {}
    for rank, keys in by_rank.items():
        for k in keys:
            if k in wanted:  # most shards stay where they are: only the wanted ones' holders matter
                holders.setdefault(k, []).append(rank)
    return assign_moves(needs, holders)


def move_rows(moves: Sequence[ShardMove]) -> list[MoveRow]:
    """`moves` as the generation record stores them."""
    return [(m.key.layer, m.key.tp_rank, m.src, m.dst) for m in moves]


def moves_of(rows: Sequence[MoveRow], plan: Plan) -> list[ShardMove]:
    """The moves of a generation record's rows; a row naming a rank outside `plan` is refused."""
    world = sum(len(pipe.stages) for pipe in plan.pipelines) * plan.gpus_per_node
    bad = [row for row in rows if not (0 <= row[2] < world and 0 <= row[3] < world)]
    if bad:
        raise ValueError(f"shard moves {bad[:3]} name ranks outside the plan's {world}")
    return [ShardMove(key=ShardKey(layer, tp), src=src, dst=dst) for layer, tp, src, dst in rows]
