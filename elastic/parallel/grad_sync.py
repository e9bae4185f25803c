"""finalize_grads: every non-obvious gradient reduction of a step, in one place.

Before this runs, each microbatch's loss was scaled by 1 / (global microbatch count) and its
gradient summed into a GradAccumulator, so a worker's sums are its pipeline's share of the
global-batch mean. Then:

1. Cross-pipeline sum per gradient bucket: every worker holding the same (layers, tp_rank)
   sums its bucket with the others, one all-reduce per bucket. The sum of the pipelines' shares
   is the mean over the whole global batch, each microbatch weighted equally.
2. The vote: one world all-reduce of the global gradient norm over all stages and
   tensor-parallel ranks (each gradient element counted once: one holder per layer, replicated
   parameters only on tensor-parallel rank 0), the loss, a failure count and a halt count. A
   worker that sees it complete knows that every worker finished its reductions, so it may
   commit without asking anyone (see elastic/records/protocol.py). If the vote's wait fails
   here, the reduced gradients are kept (VoteInterrupted): another worker may have seen it
   complete, and then this one must commit the same step during recovery.
3. Clip every gradient by the same factor (`clip_grads`, also used to complete such a step).

Tensor-parallel replicated parameters (LayerNorm, row-parallel biases) need no reduction of
their own: with replicated activations their gradients are already equal on every TP rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastic.parallel.grad_accum import GradAccumulator
from elastic.parallel.groups import ParallelGroups
from elastic.parallel.layout import GradBucket, ParallelLayout


@dataclass(frozen=True, kw_only=True)
class GradStats:
    """What the step learns from the global reduction."""

    grad_norm: float
    """Global gradient L2 norm before clipping."""
    loss: float
    """Mean loss over the global batch."""
    ok: bool
    """Whether every worker reported a usable step (finite gradients, no local error)."""
    halt: bool = False
    """Whether some worker asked the generation to halt after this step (all agree)."""


class VoteInterrupted(RuntimeError):
    """The vote's wait failed on this worker after its reductions completed: its gradients are
    reduced but not clipped, and kept for the control plane to commit or drop."""


BucketLayout = list[tuple[GradBucket, tuple[str, ...]]]
"""A worker's gradient buckets, each with the parameter names it holds (name order). Not a plan:
"plan" is the generation's parallel plan (`templates.plan.Plan`) that the buckets follow from."""


def bucket_layout(names: Sequence[str], layout: ParallelLayout, layer_of: Callable[[str], int]) -> BucketLayout:
    """My gradient buckets with the parameter names each holds: the partition a GradAccumulator
    should be built with, so each bucket is one flat buffer."""
    out = []
    for bucket in layout.buckets:
        wanted = set(bucket.layers)
        out.append((bucket, tuple(name for name in sorted(names) if layer_of(name) in wanted)))
    return out


def finalize_grads(
    accum: GradAccumulator,
    *,
    layout: ParallelLayout,
    groups: ParallelGroups,
    layer_of: Callable[[str], int],
    loss_sum: float,
    grad_clip: float,
    ok: bool = True,
    halt: bool = False,
) -> GradStats:
    """Reduce, measure and clip the accumulated gradients of this worker's stage, in place.

    `loss_sum` is this worker's contribution to the global loss (the sum of its microbatch
    losses divided by the global microbatch count; 0 except on a last stage's TP rank 0).
    Collective over every bucket group of mine and then the world group; every wait goes
    through `groups.wait` (StepAborted when the generation's abort flag is set); a failure of
    the vote's wait raises VoteInterrupted with the gradients reduced and unclipped. `halt`:
    this worker's wish to stop after this step, summed into the vote.
    """
    grads = accum.buffers
    buckets = bucket_layout(list(grads), layout, layer_of)
    params = dict(accum.named)

    # 1. Cross-pipeline bucket all-reduce. Buckets are launched in ascending layer order on
    # every worker, which is a single global order, so waits cannot form a cycle.
    pending: list[dist.Work] = []
    for bucket, names in buckets:
        group = groups.bucket_group(bucket.ranks)
        if group is None or not names:
            continue
        work = dist.all_reduce(accum.flat(names), op=dist.ReduceOp.SUM, group=group, async_op=True)
        assert work is not None
        pending.append(work)
    for work in pending:
        groups.wait(work)

    # 2. Global norm (each element once), loss and the ok flag in one world all-reduce.
    device = next(iter(grads.values())).device
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for bucket, names in buckets:
        if not names or not layout.counts_layer_for_norm(bucket.layers[0]):
            continue
        if layout.tp_rank == 0:
            sq += accum.flat(names).double().pow(2).sum()
        else:  # replicated parameters are counted on TP rank 0 only
            for name in names:
                if getattr(params[name], "tp_dim", None) is not None:
                    sq += grads[name].double().pow(2).sum()
    stats = torch.stack(
        [
            sq,
            torch.tensor(loss_sum, dtype=torch.float64, device=device),
            torch.tensor(0.0 if ok else 1.0, dtype=torch.float64, device=device),
            torch.tensor(1.0 if halt else 0.0, dtype=torch.float64, device=device),
        ]
    )
    try:
        groups.wait(dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=groups.world, async_op=True))
    except Exception as exc:
        raise VoteInterrupted(f"the vote's wait failed: {type(exc).__name__}: {exc}") from exc
    total_sq, loss, failures, halts = stats.tolist()
    norm = math.sqrt(total_sq)
    usable = failures == 0 and math.isfinite(norm)

    # 3. Clip by one factor everywhere.
    if usable:
        clip_grads(accum, grad_norm=norm, grad_clip=grad_clip)
    return GradStats(grad_norm=norm, loss=loss, ok=usable, halt=halts > 0)


def clip_grads(accum: GradAccumulator, *, grad_norm: float, grad_clip: float) -> None:
    """Scale every accumulated gradient by the clip factor of `grad_norm` (the same everywhere)."""
    if grad_clip > 0 and grad_norm > grad_clip:
        coef = grad_clip / (grad_norm + 1e-6)
        for g in accum.buffers.values():
            g.mul_(coef)
