"""Where the shards a worker misses in a new generation come from: first the collective path
(every worker of the generation sends what its peers need from it and receives what it needs,
over the generation's world group: elastic/transfer/collective.py), then a fetch function (in
a live job, gRPC from holders outside the generation, or for shards that arrived damaged)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch

from elastic.engine.shard_store import FetchFn, Held, ShardState
from elastic.parallel.groups import ParallelGroups
from elastic.parallel.layout import ParallelLayout
from elastic.transfer.collective import exchange
from elastic.transfer.moves import ShardMove
from elastic.transfer.shards import ShardKey


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def gather(
    layout: ParallelLayout, groups: ParallelGroups, missing: list[ShardKey], held: Held, *,
    moves: Sequence[ShardMove] | None, fetch: FetchFn | None, serve: Callable[[ShardKey], ShardState],
    device: torch.device,
) -> tuple[dict[ShardKey, ShardState], set[ShardKey]]:
    """The missing shards: over the collective path first (`moves`, the same on every worker of
    the generation; `serve` exports what I send), then `fetch`; and which of them came over the
    process group."""
    fetched = {} if moves is None else _exchange(layout, groups, moves, serve=serve, device=device)
    over_group = set(fetched)
    rest = [k for k in missing if k not in fetched]
    if rest and fetch is not None:
        got = fetch(rest)
        absent = sorted(set(rest) - set(got))
        if absent:
            raise ValueError(f"fetch did not return shards {absent}")
        fetched.update({k: got[k] for k in rest})
    elif rest and (held or fetched):
        raise ValueError(f"shards {rest} are not held here and no fetch function was given")
    return fetched, over_group


def _exchange(
    layout: ParallelLayout, groups: ParallelGroups, moves: Sequence[ShardMove], *,
    serve: Callable[[ShardKey], ShardState], device: torch.device,
) -> dict[ShardKey, ShardState]:
    """Send what peers of the generation need from me and receive what I need, over the world
    group (the collective shard path); returns what arrived intact."""
    if not any(m.src == layout.rank or m.dst == layout.rank for m in moves):
        return {}
    result = exchange(groups.world, rank=layout.rank, moves=moves, export=serve, wait=groups.wait,
                      device=device, post=groups.p2p, fetch=groups.fetch)
    for key, why in sorted(result.failed.items()):
        _log(f"generation {layout.generation}: shard {tuple(key)} did not arrive intact ({why}): "
             "fetching it over gRPC")
    _log(f"generation {layout.generation}: collective exchange sent {result.bytes_sent} B, received "
         f"{result.bytes_received} B in {result.seconds:.3f} s")
    return dict(result.shards)
