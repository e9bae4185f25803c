"""The sharded optimizer's checkpoints (issue 55): each slice of a layer's state is written once, by
one of its owners, with no gather (the format: `checkpoint/slices.py`).

A shard's checkpoint writer (`checkpoint/policy.py`: the holder of the lowest-numbered pipeline)
writes its head: the AdamW step count and the parameters' shapes. Slice j of the shard (the
slices of `templates.optim_slices`, cut where `aligned_cuts` cuts the flattened layer at this
worker's tensor-parallel rank) is written by one of its owners other than the shard's writer
where it has one, dealt by layer and slice, so that the slices spread over the owners (when the
shard's writer wrote every slice it owned, the lowest pipeline's worker wrote twice the others'
share and, under load, lagged behind by 7 steps while two of four workers wrote nothing; a
failure then found no complete checkpoint): the parameters' and both moments' elements of the slice, which its
owners updated at the last commit. Every worker calls it after its own commit, alone: a
checkpoint is no collective, as unsharded, so it never waits on a peer and a peer's failure
cannot cut it short (it leaves the step incomplete instead).
"""

from __future__ import annotations

from collections.abc import Sequence

from elastic.engine.checkpoint.slices import CheckpointPart, head_part, slice_part
from elastic.engine.optim_shards import slice_owners, spans
from elastic.engine.shard_store import Held
from elastic.parallel.layout import ParallelLayout
from elastic.transfer.shards import ShardKey
from templates.optim_slices import aligned_cuts


def sliced_parts(layout: ParallelLayout, held: Held, writes: Sequence[ShardKey]) -> list[CheckpointPart]:
    """My parts of a checkpoint of the committed step: the head of each shard of `writes` (those
    I write, `checkpoint_writer_shards`) and every slice of my shards that I write. The tensors
    are views of the held ones: copy them before the next commit (the checkpoint writer does)."""
    owned = slice_owners(layout)
    node_of = {w.rank: w.node for w in layout.workers}
    out: list[CheckpointPart] = []
    for key, entries in sorted(held.items()):
        names = sorted(entries)
        sizes = {n: entries[n][0].numel() for n in names}
        own = owned[key.layer]
        if key in writes:
            steps = {state.step for _, state in entries.values()}
            if len(steps) != 1:
                raise ValueError(f"shard {tuple(key)}: parameters disagree on the AdamW step count {sorted(steps)}")
            out.append(head_part(key, step=steps.pop(), shapes={n: entries[n][0].shape for n in names},
                                 slices=own.slices))
        holders = layout.holders(key.layer, key.tp_rank)
        rank_of = {node_of[r]: r for r in holders}
        cuts = aligned_cuts([sizes[n] for n in names], own.slices)
        for j, nodes in enumerate(own.owners):
            others = [n for n in nodes if rank_of[n] != holders[0]] or list(nodes)
            writer = rank_of[others[(key.layer + j) % len(others)]]
            if writer != layout.rank:
                continue
            pieces = {}
            for name, a, b in spans(names, sizes, cuts[j], cuts[j + 1]):
                param, state = entries[name]
                span = (0, sizes[name]) if state.span is None else state.span
                if not span[0] <= a < b <= span[1]:
                    raise ValueError(f"shard {tuple(key)}: {name}'s moments hold [{span[0]}, {span[1]}), "
                                     f"not slice {j}'s [{a}, {b})")
                pieces[name] = (a, (param.detach().view(-1)[a:b], *state.elements(a, b)))
            out.append(slice_part(key, index=j, slices=own.slices, pieces=pieces))
    return out
