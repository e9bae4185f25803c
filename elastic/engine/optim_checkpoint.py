"""The sharded optimizer's checkpoints (issue 55): each shard's writer gathers the moments it
lacks from their owners, so a checkpoint keeps one format whatever the optimizer.

A checkpoint shard is written by one holder (`checkpoint/policy.py`: the lowest-numbered
pipeline's). Sharded, that holder owns one slice of each of its layers' moments; for every other
slice, the slice's first owner sends it its moments (the same layer's slice at the same
tensor-parallel rank), over the generation's world group, one group a layer in ascending layer
order (both sides list the same pieces in the same order), so the writer holds one layer's
whole moments at a time on its device besides its own slices. The shard it writes has whole
moments, as an unsharded run's: `--resume` and the checkpoint fallback read it into any layout,
sharded or not (a new owner keeps its slice of a whole source: `optim_repair.py`).

The gathered moments are the committed ones (they change only at a commit, on the training
thread, which is the caller). Every worker of the generation calls it at the same point.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from elastic.comm import P2P
from elastic.engine.adamw import ParamState
from elastic.engine.optim_shards import layer_params, slice_owners, spans
from elastic.parallel.groups import ParallelGroups
from elastic.parallel.layout import ParallelLayout
from templates.optim_slices import aligned_cuts

CHECKPOINT_TAG = 1 << 26
"""Tag of the checkpoint gather's messages: apart from the step's, the gather's and the repair's."""

Moments = dict[str, tuple[torch.Tensor, torch.Tensor]]
"""Parameter name -> its whole (exp_avg, exp_avg_sq), flattened, on the host."""


def whole_moments(layout: ParallelLayout, groups: ParallelGroups, state: Mapping[str, ParamState],
                  sizes: Mapping[str, int], layer_of: Callable[[str], int]) -> Moments:
    """The whole moments of the parameters of the layers I write (empty where I write none), as
    host tensors; I send my slices to the writers that lack them. `state` and `sizes`: my
    optimizer's state and each parameter's elements. Collective over the world group."""
    owned = slice_owners(layout)
    node_of = {w.rank: w.node for w in layout.workers}
    out: Moments = {}
    for layer, names in sorted(layer_params(sizes, layer_of).items()):
        holders = layout.holders(layer)
        writer = holders[0]
        rank_of = {node_of[r]: r for r in holders}
        full = {n: (torch.zeros(sizes[n], device=groups.device), torch.zeros(sizes[n], device=groups.device))
                for n in names} if writer == layout.rank else {}
        ops: list[P2P] = []
        cuts = aligned_cuts([sizes[n] for n in names], owned[layer].slices)
        for j, nodes in enumerate(owned[layer].owners):
            src = writer if node_of[writer] in nodes else rank_of[nodes[0]]
            if layout.rank not in (src, writer):
                continue
            for name, a, b in spans(names, sizes, cuts[j], cuts[j + 1]):
                if layout.rank == src:
                    mine = state[name].elements(a, b)
                    if src == writer:
                        full[name][0][a:b].copy_(mine[0])
                        full[name][1][a:b].copy_(mine[1])
                    else:
                        ops.extend(P2P("send", t, writer, CHECKPOINT_TAG) for t in mine)
                else:
                    ops.extend(P2P("recv", t[a:b], src, CHECKPOINT_TAG) for t in full[name])
        if ops:
            groups.wait(groups.post(groups.world, ops))
        out.update({n: (groups.fetch(m).cpu(), groups.fetch(v).cpu()) for n, (m, v) in full.items()})
    return out
