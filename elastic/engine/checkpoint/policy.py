"""Which worker writes which shard of a checkpoint: exactly one writer per (layer, tp_rank), the
holder in the lowest-numbered pipeline."""

from __future__ import annotations

from typing import Protocol

from elastic.transfer.shards import ShardKey
from templates.plan import StagePlan


class LayoutLike(Protocol):
    """What `checkpoint_writer_shards` needs of a `ParallelLayout`."""

    @property
    def rank(self) -> int: ...

    @property
    def tp_rank(self) -> int: ...

    @property
    def stage_plan(self) -> StagePlan: ...

    def holders(self, layer: int, tp_rank: int | None = None) -> tuple[int, ...]: ...


def checkpoint_writer_shards(layout: LayoutLike) -> list[ShardKey]:
    """The shards this worker writes: those of its stage for which it is the holder of the
    lowest-numbered pipeline. Ranks are dealt pipeline by pipeline, so that holder is the one
    with the lowest global rank; every (layer, tp_rank) gets exactly one writer."""
    t = layout.tp_rank
    return [ShardKey(layer, t) for layer in layout.stage_plan.held if layout.holders(layer, t)[0] == layout.rank]
