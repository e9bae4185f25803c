"""The gradient exchange's second phase under the sharded optimizer (issue 55): each holder of a
bucket sends each element of its slice of the reduced result only to the holders that update
that element, not to every holder.

Unsharded, a bucket's second phase is an all-gather: each of the P holders sends its 1/P slice
of the result to the other P - 1 (elastic/parallel/exchange.py). Sharded, a holder updates only
its optimizer slices (`optim_shards.owned_ranges`), and the step's parameter gather brings it the
rest, so it needs the reduced gradient of those elements only. Each element then crosses the
wire to its f + 1 owners (f where the slice's exchange holder is one of them) in the second
phase and to the P - f - 1 other holders in the gather: P - 1 or P copies in all, the bytes of
the unsharded step (P - 1) within one copy, where the gather alone used to come on top.

The elements a holder does not update are left unreduced in its buffers: nothing reads them
(the optimizer reads its spans, the norm is measured in the exchange). So the norm of a
tensor-parallel rank above 0, which the unsharded step measures after the reduction from the
whole gradient, is measured by the exchange too, over the runs of its slice that rank counts
(`counted`: sharded parameters' elements, a shared key/value head's first replica only), in
every bucket of a sharded step (the memory model counts its buffers: `planning/footprint.py`
`GradShare.measures`). Buckets holding a tied embedding or head (tied.py sums both copies after
the reduction, whole) keep the all-gather, as runs.

Both holders of a pair list their spans in ascending element order, so the k-th message one
sends the other is the k-th it receives (one group per bucket, as before: NCCL's rules hold).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from itertools import accumulate

import torch

from elastic.engine.optim_shards import GatherGroup, gather_plan, layer_params, slice_owners, spans
from elastic.model.naming import EMBEDDING, HEAD
from elastic.parallel.buckets import BucketLayout
from elastic.parallel.exchange import SecondPhase, Span
from elastic.parallel.grad_sync import counted_span
from elastic.parallel.layout import ParallelLayout
from templates.optim_slices import SliceOwnership, aligned_cuts

Run = tuple[int, int]


def second_phases(
    layout: ParallelLayout, buckets: BucketLayout, sizes: Mapping[str, int], layer_of: Callable[[str], int], *,
    counted: Callable[[str], Run] | None = None, whole: Collection[str] = (),
) -> dict[tuple[str, ...], SecondPhase]:
    """My second phase of every bucket I share (`buckets`: (bucket, its names in flat order)),
    by the bucket's names. `counted`: name -> the elements of its flattened gradient this rank
    counts in the norm (None: all, tensor-parallel rank 0). A bucket holding a name of `whole`
    is all-gathered (every holder wants every element), with the same norm runs."""
    owned = slice_owners(layout)
    node_of = {w.rank: w.node for w in layout.workers}
    out: dict[tuple[str, ...], SecondPhase] = {}
    for bucket, names in buckets:
        if len(bucket.ranks) < 2 or not names:
            continue
        mine = {n: sizes[n] for n in names}
        offsets = dict(zip(names, accumulate((sizes[n] for n in names), initial=0), strict=False))
        holders = len(bucket.ranks)
        length = -(-sum(mine.values()) // holders)
        runs: list[tuple[Run, ...]]
        if any(n in whole for n in names):  # every holder wants all of it: the all-gather, as runs
            runs = [((0, holders * length),)] * holders
        else:
            runs = _owner_runs(mine, offsets, layer_of, owned, [node_of[r] for r in bucket.ranks])
        me = bucket.ranks.index(layout.rank)
        posts = [Span("send", i, a, b) for i in range(holders) if i != me
                 for a, b in _within(runs[i], me * length, (me + 1) * length)]
        posts += [Span("recv", j, a, b) for j in range(holders) if j != me
                  for a, b in _within(runs[me], j * length, (j + 1) * length)]
        measured = None if counted is None else _merged(
            (offsets[n] + a, offsets[n] + b) for n in names for a, b in [counted(n)])
        out[names] = SecondPhase(spans=tuple(posts), counted=measured)
    return out


def sharded_paths(layout: ParallelLayout, module: torch.nn.Module, buckets: BucketLayout,
                  layer_of: Callable[[str], int], *, on: bool, tree: bool, tied: bool,
                  ) -> tuple[list[GatherGroup] | None, dict[tuple[str, ...], SecondPhase] | None]:
    """A step transaction's transfers with the optimizer sharded (`on`; else none): the parameter
    gather (`optim_shards.gather_plan`), and with the summation tree the exchange's second
    phase of each bucket of my stage `module` (`second_phases`; `tied`: its embedding and head
    are tied)."""
    if not on:
        return None, None
    params = dict(module.named_parameters())
    sizes = {n: p.numel() for n, p in params.items()}
    phases = second_phases(
        layout, buckets, sizes, layer_of, whole=(EMBEDDING, HEAD) if tied else (),
        counted=None if layout.tp_rank == 0 else lambda name: counted_span(params[name], layout)) if tree else None
    return gather_plan(layout, sizes, layer_of), phases


def _owner_runs(sizes: Mapping[str, int], offsets: Mapping[str, int], layer_of: Callable[[str], int],
                owned: Sequence[SliceOwnership], nodes: list[int]) -> list[tuple[Run, ...]]:
    """Per holder (`nodes`, in bucket order), the runs of the bucket's flat buffer it updates:
    its slice of each of the bucket's layers (`sizes`: whole layers), each slice's runs cut once."""
    per_node: dict[int, list[Run]] = {}
    for layer, names in layer_params(sizes, layer_of).items():
        own = owned[layer]
        cuts = aligned_cuts([sizes[n] for n in names], own.slices)
        for j, owners in enumerate(own.owners):
            runs = [(offsets[n] + a, offsets[n] + b) for n, a, b in spans(names, sizes, cuts[j], cuts[j + 1])]
            for node in owners:
                per_node.setdefault(node, []).extend(runs)
        owning = {node for owners in own.owners for node in owners}
        lacking = [node for node in nodes if node not in owning]
        if lacking:
            raise ValueError(f"node {lacking[0]} holds layer {layer} but owns none of its optimizer slices")
    return [_merged(per_node.get(node, ())) for node in nodes]


def _merged(runs: Iterable[Run]) -> tuple[Run, ...]:
    """Non-empty runs, ascending, adjacent ones joined."""
    out: list[Run] = []
    for a, b in sorted(r for r in runs if r[0] < r[1]):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def _within(runs: tuple[Run, ...], lo: int, hi: int) -> list[Run]:
    """`runs` cut to [lo, hi)."""
    return [(max(a, lo), min(b, hi)) for a, b in runs if max(a, lo) < min(b, hi)]
