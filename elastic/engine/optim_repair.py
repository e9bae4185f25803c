"""A generation change's moments under the sharded optimizer (issue 55): every new owner of a slice
gets what it lacks of it from a worker that has it, over the new generation's world group.

Each worker says which elements of each layer it has moments of (its old slice of a kept
shard, all of a shard fetched from a checkpoint or an unsharded holder, nothing of a shard
fetched from a sharded holder): one all-gather of a (layers x 2) table. From the tables and the
new owners (`optim_shards.slice_owners`) every worker computes the same moves (`_pieces`): for
each holder of a layer, the elements of its new slice it lacks, each taken from a worker of the
same tensor-parallel rank that has them, chosen among those by the holder's rank (so the sends
spread without a global tally). A move carries the parameters too: the sender had those elements in its slice, so its
parameters there are the committed ones; the receiver's other parameters may be an update
behind and are brought up by the next step's gather (`StepTransaction.behind`). All sends and
receives are one group on the world communicator. A range that no live worker has raises
`MomentsLost`, which names the layer and the elements: only a checkpoint has them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from elastic.comm import P2P
from elastic.engine.adamw import ParamState
from elastic.engine.optim_shards import layer_params, slice_owners, spans
from elastic.parallel.groups import ParallelGroups
from elastic.parallel.layout import ParallelLayout
from elastic.transfer.shards import ShardKey
from templates.optim_slices import SliceOwnership

REPAIR_TAG = 1 << 25
"""The tag of the repair's messages (apart from the gather's and the exchange's)."""

Source = tuple[torch.Tensor, ParamState]
"""A parameter's tensor and the moments I have of it (`ParamState.span` says which elements)."""


class MomentsLost(RuntimeError):
    """Elements of a layer's optimizer state that no live worker has: only a checkpoint has them."""


@dataclass(frozen=True)
class _Move:
    layer: int
    dst: int
    src: int
    start: int
    stop: int


def _covered(names: list[str], sources: Mapping[str, Source]) -> tuple[int, int]:
    """The elements [lo, hi) of the flattened layer of `names` whose moments I have."""
    offset, lo, hi, total = 0, -1, -1, 0
    for name in names:
        param, st = sources[name]
        a, b = st.span if st.span is not None else (0, param.numel())
        if a < b:
            lo = offset + a if lo < 0 else lo
            hi, total = offset + b, total + b - a
        offset += param.numel()
    if total != max(hi - lo, 0):
        raise ValueError(f"the moments of {names[0]}'s layer are not one contiguous range")
    return (lo, hi) if total else (0, 0)


def moment_spans(held: Mapping[ShardKey, Mapping[str, Source]]) -> list[tuple[int, int, int, int, int]]:
    """(layer, tp_rank, lo, hi, total) of each shard in `held` (a trainer's): the elements [lo, hi)
    of the flattened shard, of `total`, whose moments it has; what its sync report says
    (SyncReport.moments), for the leader to find elements no live worker has."""
    out = []
    for key, shard in sorted(held.items()):
        names = sorted(shard)  # the order slices are cut in (optim_shards.layer_params)
        lo, hi = _covered(names, shard)
        out.append((key.layer, key.tp_rank, lo, hi, sum(param.numel() for param, _ in shard.values())))
    return out


def _subtract(a: int, b: int, lo: int, hi: int) -> list[tuple[int, int]]:
    return [(x, y) for x, y in ((a, min(b, lo)), (max(a, hi), b)) if x < y] if lo < hi else ([(a, b)] if a < b else [])


def _pieces(layout: ParallelLayout, tables: list[list[tuple[int, int]]], layer: int, own: SliceOwnership,
            names: list[str], sizes: Mapping[str, int]) -> Iterator[_Move]:
    """Every move of `layer` (its owners `own`) between workers of my tensor-parallel rank, in one
    order for all."""
    peers = [w for w in layout.workers if w.tp_rank == layout.tp_rank]
    for w in sorted(layout.workers, key=lambda w: w.rank):
        if w.tp_rank != layout.tp_rank or not layout.plan.pipelines[w.pipeline].stages[w.stage].holds(layer):
            continue
        j = own.slice_of(w.node)
        assert j is not None
        a, b = own.bounds(j, [sizes[n] for n in names])
        lo, hi = tables[w.rank][layer]
        for x, y in _subtract(a, b, lo, hi):
            while x < y:
                have = sorted(p.rank for p in peers if p.rank != w.rank and tables[p.rank][layer][0] <= x
                              < tables[p.rank][layer][1])
                if not have:
                    raise MomentsLost(f"layer {layer}: optimizer elements [{x}, {y}) of its tensor-parallel rank "
                                      f"{layout.tp_rank} have no live owner; only a checkpoint has them")
                src = have[(w.rank + layer) % len(have)]
                stop = min(y, tables[src][layer][1])
                yield _Move(layer=layer, dst=w.rank, src=src, start=x, stop=stop)
                x = stop


def repair_moments(layout: ParallelLayout, groups: ParallelGroups, *, sources: Mapping[str, Source],
                   owned: Mapping[str, tuple[int, int]], layer_of: Callable[[str], int],
                   ) -> tuple[dict[str, ParamState], int]:
    """The moments of my new slices (`owned`, for the parameters of my new stage), from what I have
    (`sources`: every parameter I hold or fetched, by name) and what the others send, and the
    bytes I received; parameters received are written into `sources`' tensors. Collective over
    the world group."""
    sizes = {n: p.numel() for n, (p, _) in sources.items()}
    by_layer = layer_params(sizes, layer_of)
    table = torch.full((layout.plan.num_layers, 2), -1, dtype=torch.int64)
    for layer, names in by_layer.items():
        table[layer] = torch.tensor(_covered(names, sources))
    device = groups.device
    parts = [torch.empty_like(table, device=device) for _ in range(layout.world_size)]
    groups.wait(groups.world.all_gather(parts, table.to(device)))
    tables = [[(int(lo), int(hi)) for lo, hi in groups.fetch(t).tolist()] for t in parts]
    fresh = {n: ParamState(exp_avg=sources[n][0].new_zeros(b - a), exp_avg_sq=sources[n][0].new_zeros(b - a),
                           step=sources[n][1].step, span=(a, b)) for n, (a, b) in owned.items()}
    ops: list[P2P] = []
    owned_by = slice_owners(layout)  # once: each call derives the plan's own when the record names none
    for layer, names in sorted(by_layer.items()):
        for move in _pieces(layout, tables, layer, owned_by[layer], names, sizes):
            if layout.rank not in (move.src, move.dst):
                continue
            for name, a, b in spans(names, sizes, move.start, move.stop):
                param, st = sources[name]
                if move.src == layout.rank:
                    moments, kind, peer = st.elements(a, b), "send", move.dst
                else:
                    moments, kind, peer = fresh[name].elements(a, b), "recv", move.src
                ops.extend(P2P(kind, t, peer, REPAIR_TAG) for t in (param.detach().view(-1)[a:b], *moments))
    _copy_kept(fresh, sources)
    if ops:
        groups.wait(groups.post(groups.world, ops))
    return fresh, sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.kind == "recv")


def _copy_kept(fresh: Mapping[str, ParamState], sources: Mapping[str, Source]) -> None:
    """The part of each new slice I already have, copied from my old moments."""
    for name, new in fresh.items():
        param, st = sources[name]
        a, b = st.span if st.span is not None else (0, param.numel())
        assert new.span is not None
        x, y = max(a, new.span[0]), min(b, new.span[1])
        if x < y:
            new.exp_avg[x - new.span[0] : y - new.span[0]].copy_(st.exp_avg.view(-1)[x - a : y - a])
            new.exp_avg_sq[x - new.span[0] : y - new.span[0]].copy_(st.exp_avg_sq.view(-1)[x - a : y - a])
