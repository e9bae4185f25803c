"""What a worker adds to a step it replays only in part (elastic/records/partial.py): the kept
gradient sums of the microbatches that step finished before it was interrupted.

A keeper brings its own sums of the layers it still holds; sums of layers that moved are sent
from their keepers to their new holders over the new generation's world group, as the shards
are (elastic/transfer/collective.py), under a tag of their own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from elastic.engine.shard_store import ShardState
from elastic.engine.step import KeptGrads, StepReplay, replay_blocks
from elastic.parallel.blocks import Block
from elastic.parallel.groups import ParallelGroups
from elastic.parallel.layout import ParallelLayout, assign_ranks
from elastic.records.partial import ReplayRecord, split_microbatches
from elastic.transfer.collective import exchange
from elastic.transfer.moves import ShardMove
from elastic.transfer.shards import ShardKey

_SUMS_TAG = 8
"""Tag of the kept gradient sums' exchange (the shards' own exchange uses the default, 7)."""

Sums = dict[Block, dict[str, torch.Tensor]]
"""Block of microbatches -> canonical parameter name -> gradient sum."""


def step_replay(
    layout: ParallelLayout, groups: ParallelGroups, replay: ReplayRecord | None, step: int, *,
    kept: KeptGrads | None, layer_of: Callable[[str], int], device: torch.device,
) -> StepReplay | None:
    """What this worker computes and adds in step `step` when it replays only part of it (None
    when it replays all of it); `kept`: this worker's own kept sums. Kept sums of layers that
    moved are exchanged here, over the new world group."""
    if replay is None or replay.step != step or not replay.kept:
        return None
    mine = None
    if replay.is_keeper(layout.node, layout.local_rank):
        mine = kept
        if mine is None or mine.step != step or not set(mine.microbatches) <= set(replay.kept):
            raise ValueError(
                f"generation {layout.generation} counts on this worker's kept sums of step {step}, "
                f"but it keeps {None if mine is None else (mine.step, list(mine.microbatches))}"
            )
    stage = layout.stage_plan
    sums: Sums = {}
    for block, named in ({} if mine is None else mine.grads).items():
        held = {n: t for n, t in named.items() if stage.holds(layer_of(n))}
        if held:
            sums.setdefault(block, {}).update(held)
    for block, named in _moved_sums(layout, groups, replay, mine, layer_of=layer_of, device=device).items():
        sums.setdefault(block, {}).update(named)
    shares = split_microbatches(layout.plan, replay.missing)
    return StepReplay(step=step, microbatches=shares[layout.pipeline], blocks=replay_blocks(replay, layout.plan),
                      sums=sums, loss_sum=0.0 if mine is None else mine.loss_sum,
                      finite=True if mine is None else mine.finite)


def _moved_sums(
    layout: ParallelLayout, groups: ParallelGroups, replay: ReplayRecord, kept: KeptGrads | None, *,
    layer_of: Callable[[str], int], device: torch.device,
) -> Sums:
    """Send my kept sums of layers I no longer hold to their new holders, and receive those
    moved to me (`replay.moved`)."""
    ranks = {(w.node, w.local_rank): w.rank for w in assign_ranks(layout.plan)}
    moves = [ShardMove(key=ShardKey(layer, tp), src=ranks[(fn, fr)], dst=ranks[(tn, tr)])
             for layer, tp, fn, fr, tn, tr in replay.moved]

    def export(key: ShardKey) -> ShardState:
        assert kept is not None, "asked to send kept sums this worker does not keep"
        return {f"grad/{b.start}/{b.size}/{n}": t for b, named in kept.grads.items()
                for n, t in named.items() if layer_of(n) == key.layer}

    out: Sums = {}
    for batch in _rounds(moves):  # a holder may get one layer's sums from two keepers: one each round
        if not any(layout.rank in (m.src, m.dst) for m in batch):
            continue
        result = exchange(groups.world, rank=layout.rank, moves=batch, export=export, wait=groups.wait,
                          tag=_SUMS_TAG, device=device, post=groups.p2p, fetch=groups.fetch)
        if result.failed:
            raise ValueError(f"kept gradient sums did not arrive intact: {dict(result.failed)}")
        for shard in result.shards.values():
            for key, t in shard.items():
                _, start, size, name = key.split("/", 3)
                out.setdefault(Block(int(start), int(size)), {})[name] = t
    return out


def _rounds(moves: list[ShardMove]) -> list[list[ShardMove]]:
    """`moves` split into rounds in which no (shard, receiver) pair repeats: the n-th move of
    each pair, by sender, in round n (every worker computes the same rounds)."""
    rounds: list[list[ShardMove]] = []
    seen: dict[tuple[ShardKey, int], int] = {}
    for m in sorted(moves, key=lambda m: (m.src, m.dst, m.key)):
        n = seen.get((m.key, m.dst), 0)
        seen[(m.key, m.dst)] = n + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(m)
    return rounds
