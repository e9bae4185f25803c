"""The planner's memory figures: what its memory check (`templates.profile.MemoryModel`) adds to
the layers' own bytes, per parameter (gradient and exchange buffers, work buffers spread over a
bucket) and per worker (fixed work buffers), the largest over the pipeline counts a cluster may
run, computed from the memory model of `footprint.py` and the even splits of `split_blocks.py`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastic.planning.footprint import (
    BUCKET_BYTES,
    CHUNKED_DEVICE_TYPES,
    GRAD_BYTES,
    LOSS_BYTES,
    NORM_BYTES,
    SUM_CHUNK,
    ShareCounts,
    ShareLike,
    bucket_work_bytes,
    grad_bytes_per_param,
    worker_work_bytes,
)
from elastic.planning.split_blocks import even_split_blocks


@dataclass(frozen=True, kw_only=True)
class PlannerFigures:
    """What the planner's memory check adds to the layers' own bytes (`templates.profile.MemoryModel`)."""

    grad_bytes_per_param: float
    """Gradient and exchange bytes per parameter, with the buckets' work buffers spread over them."""
    worker_bytes: int
    """Fixed bytes per worker: the norm's float64 chunk, the step count, two buckets' work buffers."""


def planner_figures(
    *, global_microbatches: int, min_pipelines: int = 1, max_pipelines: int = 1, partial_replay: bool = True,
    device_type: str = "cpu",
) -> PlannerFigures:
    """The largest figures over plans of `min_pipelines`..`max_pipelines` pipelines splitting the
    step's microbatches evenly (as far as they go: at most one pipeline per microbatch), on
    tensor-parallel rank 0 of a `device_type` device. Exact for one pipeline whose share is one
    block (a power of two); otherwise an upper bound for the even split: each bucket's fixed work
    buffers and padding are counted at their largest, spread over a full bucket beyond two."""
    if global_microbatches < 1 or min_pipelines < 1:
        raise ValueError(f"{global_microbatches} microbatches, {min_pipelines} pipelines")
    grad, worker = 0.0, 0
    for p in range(min_pipelines, max(min_pipelines, min(max_pipelines, global_microbatches)) + 1):
        # A holder's figures depend on its own blocks only through their number and tree levels
        # (the peers' count is the rest, the combine is of every holder's blocks): one holder of
        # each kind stands for all, and the split's blocks come as arrays (split_blocks.py).
        split = even_split_blocks(global_microbatches, p)
        total, scratch = len(split.starts), split.scratch()
        for blocks, levels in split.kinds():
            share = ShareCounts(pipelines=p, own_blocks=blocks, levels=levels, peer_blocks=total - blocks,
                                scratch=scratch, snapshot=partial_replay and p > 1)
            figures = holder_figures(share, device_type)
            grad = max(grad, figures.grad_bytes_per_param)
            worker = max(worker, figures.worker_bytes)
    return PlannerFigures(grad_bytes_per_param=grad, worker_bytes=worker)


def holder_figures(share: ShareLike, device_type: str = "cpu") -> PlannerFigures:
    """`planner_figures` of one holder in the tree `share`."""
    p = share.pipelines
    padding = (p - 1) * (GRAD_BYTES * share.copies + GRAD_BYTES * share.peer_blocks / p)
    fixed, per_param = _bucket_work_bound(share, device_type)
    bucket = fixed + padding
    loss = LOSS_BYTES if share.snapshot else 0
    return PlannerFigures(
        grad_bytes_per_param=grad_bytes_per_param(share) + per_param + bucket * GRAD_BYTES / BUCKET_BYTES,
        worker_bytes=worker_work_bytes(device_type) + loss + 2 * math.ceil(bucket),
    )


def _bucket_work_bound(share: ShareLike, device_type: str) -> tuple[float, float]:
    """(a, b): `bucket_work_bytes` of a bucket of n parameters is at most a + b x n."""
    if device_type in CHUNKED_DEVICE_TYPES:  # chunks of at most SUM_CHUNK elements: a constant
        return float(bucket_work_bytes(share.pipelines * SUM_CHUNK, share, device_type)), 0.0
    p = share.pipelines
    scratch = GRAD_BYTES * share.combine_scratch()  # slice-long buffers, a slice rounded up
    return scratch + (NORM_BYTES if share.measures and p > 1 else 0.0), scratch / p
