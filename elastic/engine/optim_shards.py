"""The sharded optimizer's part of a worker's stage (issue 55): which elements it updates, and the
gather that brings it every other owner's updates.

A layer's AdamW state is cut into the slices of `templates.optim_slices`, each owned by f + 1 or
more of the layer's holders in different pipelines (`slice_owners`: the generation record's
owners, which the leader chose to keep survivors on their slices, or the plan's own). The
flattened layer is its parameters in name order (the order of `aligned_cuts`' sizes), at this
worker's tensor-parallel rank; every rank of a node owns the same slice of its own shard. An
owner keeps moments of its slice only and updates only its slice's parameters
(`MasterAdamW(owned=...)`): the commit stays local, so a step still commits everywhere or
changes nothing.

The other parameters are one update behind until the next step begins: `gather_params` sends
each slice's updated parameters from its owners to the holders that do not own it. Each owner
of a slice sends an even share of it (split by element, in owner order), so f + 1 owners send
a slice's bytes once between them. The gather is idempotent (it copies committed values), so
one cut short by a failure is simply repeated. It posts one group per layer, in ascending layer
order (the order of a stage's forward: a step waits for each layer's group right before that
layer's first forward, elastic/engine/param_gather.py), on the world communicator, from the
training thread: the bucket communicators are the exchange thread's, and NCCL's group state is
per thread, so a communicator is posted from one thread only (elastic/comm/nccl_model.py found
it). Both sides of a pair list its pieces in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from elastic.comm import P2P, Handle
from elastic.parallel.groups import ParallelGroups
from elastic.parallel.layout import ParallelLayout
from templates.optim_slices import SliceOwnership, aligned_cuts, plan_owners

GATHER_TAG = 1 << 24
"""Tags of the gather's messages start here: apart from the exchange's (2 x layer, 2 x layer + 1)."""


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of parameter `name` (flattened) sent to or received from `peer`
    (the holder's rank in the generation's world group)."""

    kind: str
    name: str
    start: int
    stop: int
    peer: int


@dataclass(frozen=True, kw_only=True)
class GatherGroup:
    """The pieces of one layer's gather among its holders `ranks`, in posting order (both sides
    list them alike)."""

    layer: int
    ranks: tuple[int, ...]
    tag: int
    pieces: tuple[Piece, ...]


def slice_owners(layout: ParallelLayout) -> Sequence[SliceOwnership]:
    """Every layer's slice owners in `layout`'s generation, by layer: the record's
    (`layout.owners`), else the plan's own."""
    if layout.owners is not None:
        return layout.owners
    owned = plan_owners(layout.plan)
    return [owned[layer] for layer in range(layout.plan.num_layers)]


def layer_params(sizes: Mapping[str, int], layer_of: Callable[[str], int]) -> dict[int, list[str]]:
    """Layer -> its parameters' names in name order (the order slices are cut in)."""
    out: dict[int, list[str]] = {}
    for name in sorted(sizes):
        out.setdefault(layer_of(name), []).append(name)
    return out


def spans(names: list[str], sizes: Mapping[str, int], lo: int, hi: int) -> Iterator[tuple[str, int, int]]:
    """Elements [lo, hi) of the flattened layer of `names`, as (name, start, stop) per parameter."""
    offset = 0
    for name in names:
        a, b = max(lo, offset), min(hi, offset + sizes[name])
        if a < b:
            yield name, a - offset, b - offset
        offset += sizes[name]


def owned_ranges(layout: ParallelLayout, sizes: Mapping[str, int], layer_of: Callable[[str], int]) -> dict[str, tuple[int, int]]:
    """Per parameter of my stage (`sizes`: name -> elements), the elements I update: my node's
    slice of its layer, cut where `aligned_cuts` cuts; (0, 0) for a parameter my slice misses."""
    owned = slice_owners(layout)
    out: dict[str, tuple[int, int]] = {}
    for layer, names in layer_params(sizes, layer_of).items():
        own = owned[layer]
        j = own.slice_of(layout.node)
        if j is None:
            raise ValueError(f"node {layout.node} holds layer {layer} but owns none of its optimizer slices")
        lo, hi = own.bounds(j, [sizes[n] for n in names])
        out.update(dict.fromkeys(names, (0, 0)))
        out.update({name: (a, b) for name, a, b in spans(names, sizes, lo, hi)})
    return out


def gather_plan(layout: ParallelLayout, sizes: Mapping[str, int], layer_of: Callable[[str], int]) -> list[GatherGroup]:
    """My part of the gather: per layer of mine held elsewhere too (ascending), the pieces I send
    (my share of my slice, to each holder that does not own it) and receive."""
    owned = slice_owners(layout)
    by_layer = layer_params(sizes, layer_of)
    node_of = {w.rank: w.node for w in layout.workers}
    out: list[GatherGroup] = []
    for bucket in layout.buckets:
        if len(bucket.ranks) < 2:
            continue
        peer = {node_of[r]: r for r in bucket.ranks}
        for layer in bucket.layers:
            pieces: list[Piece] = []
            names = by_layer.get(layer, [])
            cuts = aligned_cuts([sizes[n] for n in names], owned[layer].slices)
            for j, nodes in enumerate(owned[layer].owners):
                others = [n for n in peer if n not in nodes]
                for k, sender in enumerate(nodes):
                    lo = cuts[j] + (cuts[j + 1] - cuts[j]) * k // len(nodes)
                    hi = cuts[j] + (cuts[j + 1] - cuts[j]) * (k + 1) // len(nodes)
                    for name, a, b in spans(names, sizes, lo, hi):
                        if sender == layout.node:
                            pieces.extend(Piece("send", name, a, b, peer[n]) for n in others)
                        elif layout.node in others:
                            pieces.append(Piece("recv", name, a, b, peer[sender]))
            if pieces:
                out.append(GatherGroup(layer=layer, ranks=bucket.ranks, tag=GATHER_TAG + layer, pieces=tuple(pieces)))
    return out


def gather_params(plan: list[GatherGroup], params: Mapping[str, torch.Tensor], groups: ParallelGroups) -> int:
    """Run the gather `plan` over `params` (name -> tensor, written in place where received):
    every group posted, then waited, abortably. Bytes sent."""
    pending = post_gather(plan, params, groups.p2p)
    pending.wait_all(groups.wait)
    return pending.sent


@dataclass
class PendingGather:
    """A posted gather: each layer's handles until they are waited for."""

    handles: dict[int, list[Handle]]
    sent: int
    """Bytes this worker sends."""

    def wait_layer(self, layer: int, wait: Callable[[Handle], None]) -> None:
        """Wait (with `wait`) for layer `layer`'s group, if it is still pending (a handle is
        forgotten only once its wait returned)."""
        handles = self.handles.get(layer, [])
        while handles:
            wait(handles[0])
            handles.pop(0)
        self.handles.pop(layer, None)

    def wait_all(self, wait: Callable[[Handle], None]) -> None:
        """Wait for every group still pending, in posting order."""
        for layer in sorted(self.handles):
            self.wait_layer(layer, wait)


def post_gather(plan: list[GatherGroup], params: Mapping[str, torch.Tensor], post: Callable[[list[P2P]], Handle]) -> PendingGather:
    """Post every group of the gather `plan` over `params` (in `plan`'s order, with `post`); wait for nothing."""
    handles: dict[int, list[Handle]] = {}
    sent = 0
    with torch.no_grad():
        for group in plan:
            ops = [P2P(p.kind, params[p.name].view(-1)[p.start : p.stop], p.peer, group.tag) for p in group.pieces]
            sent += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.kind == "send")
            handles.setdefault(group.layer, []).append(post(ops))
    return PendingGather(handles=handles, sent=sent)
