"""Create the process groups a ParallelLayout names, in one order on every worker.

`dist.new_group` is collective over the whole world: every worker must call it for every group,
in the same order, even for groups it is not a member of. The layout's `all_group_ranks()` gives
that order. The result is a plain object passed explicitly to whoever needs a group.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from elastic.model.tensor_parallel import TensorParallel
from elastic.parallel.layout import ParallelLayout


@dataclass(frozen=True, kw_only=True)
class ParallelGroups:
    """The process groups one worker uses in one generation."""

    world: dist.ProcessGroup
    """Every worker of the generation (step agreement, global grad norm, loss)."""
    tp: TensorParallel
    """My tensor-parallel context (group of my node's workers)."""
    buckets: dict[tuple[int, ...], dist.ProcessGroup | None]
    """Gradient-bucket group for each holder rank set of mine; None for a set of one."""

    def bucket_group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        return self.buckets[ranks]


def build_groups(
    layout: ParallelLayout, world: dist.ProcessGroup, *, timeout: timedelta | None = None
) -> ParallelGroups:
    """Create every group of `layout` (collective over `world`, which must be its world)."""
    if dist.get_world_size(world) != layout.world_size:
        raise ValueError(
            f"world group has {dist.get_world_size(world)} ranks but the plan needs {layout.world_size}"
        )
    if dist.get_rank(world) != layout.rank:
        raise ValueError(f"world rank {dist.get_rank(world)} differs from the layout's rank {layout.rank}")
    created: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for ranks in layout.all_group_ranks():
        group = dist.new_group(list(ranks), timeout=timeout)
        if layout.rank in ranks:
            created[ranks] = group
    tp_ranks = layout.tp_ranks
    tp = (
        TensorParallel(group=created[tp_ranks], rank=layout.tp_rank, size=layout.tp_size)
        if len(tp_ranks) > 1
        else TensorParallel.single()
    )
    buckets = {b.ranks: created.get(b.ranks) for b in layout.buckets}
    return ParallelGroups(world=world, tp=tp, buckets=buckets)
