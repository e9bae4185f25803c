"""finalize_grads: every non-obvious gradient reduction of a step, in one place.

Before this runs, each microbatch's loss was scaled by 1 / (global microbatch count) and its
gradient summed into a GradAccumulator, so a worker's sums are its pipeline's share of the
global-batch mean. Then:

1. Cross-pipeline sum per gradient bucket: every worker holding the same (layers, tp_rank)
   sums its bucket with the others. The sum of the pipelines' shares is the mean over the whole
   global batch, each microbatch weighted equally. A `BucketReducer` launches each bucket's
   reduction as soon as its sums are final (the last backward of the step added all of its
   gradients), in one global order (buckets by descending layer, the order a backward finishes
   them), so the reduction overlaps the rest of the backward as DDP's does; the waits happen
   here, each through `groups.wait` (StepAborted when the generation's abort flag is set).
2. The vote: one world all-reduce of the global gradient norm over all stages and
   tensor-parallel ranks (each gradient element counted once: a bucket the tree exchange
   reduced is measured by every holder, each its own slice of the result; any
   other bucket by its lowest-rank holder; replicated parameters only on tensor-parallel rank
   0, so on the other TP ranks it is measured per parameter after the reduction, a shared
   key/value head on its first replica only: model/kv_layout.py), the loss, a
   failure count and a halt count. A
   worker that sees it complete knows that every worker finished its reductions, so it may
   commit without asking anyone (see elastic/records/sync.py). If the vote's wait fails
   here, the reduced gradients are kept (VoteInterrupted): another worker may have seen it
   complete, and then this one must commit the same step during recovery.
3. Clip every gradient by the same factor (`clip_grads`, also used to complete such a step).

How a bucket is reduced (the summation tree on the wire): bucket_reducer.py. How a worker's
layers are cut into buckets: buckets.py.

Tensor-parallel replicated parameters (LayerNorm, row-parallel biases) need no reduction of
their own: with replicated activations their gradients are already equal on every TP rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from elastic.model.naming import EMBEDDING, HEAD
from elastic.parallel.blocks import sum_of_squares
from elastic.parallel.bucket_reducer import BucketReducer
from elastic.parallel.grad_accum import GradAccumulator
from elastic.parallel.groups import ParallelGroups
from elastic.parallel.layout import ParallelLayout
from elastic.parallel.phase_clock import StepPhases
from elastic.parallel.tied import sum_tied_grads

__all__ = ["GradStats", "VoteInterrupted", "clip_grads", "counted_span", "finalize_grads", "sum_of_squares"]


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
    phases: dict[int, StepPhases] = field(default_factory=dict)
    """Each plan node's forward, backward and wait seconds of the step (its tensor-parallel rank
    0's; elastic/parallel/phase_clock.py), carried by the vote; 0 where unmeasured."""


class VoteInterrupted(RuntimeError):
    """The vote's wait failed on this worker after its reductions completed: its gradients are
    reduced but not clipped, and kept for the control plane to commit or drop."""


_UNMEASURED = StepPhases()


def finalize_grads(
    accum: GradAccumulator,
    *,
    layout: ParallelLayout,
    groups: ParallelGroups,
    layer_of: Callable[[str], int],
    loss_sum: torch.Tensor | float,
    grad_clip: float,
    ok: bool = True,
    halt: bool | Callable[[], bool] = False,
    reducer: BucketReducer | None = None,
    phases: StepPhases | Callable[[], StepPhases] = _UNMEASURED,
    tied: bool = False,
) -> GradStats:
    """Reduce, measure and clip the accumulated gradients of this worker's stage, in place.

    `loss_sum` is this worker's contribution to the global loss (the sum of its microbatch
    losses divided by the global microbatch count; 0 except on a last stage's TP rank 0), a
    float64 value that may stay on the device (read back with the vote); a non-finite one counts
    as a failure, like `ok=False`.
    Collective over every bucket group of mine and then the world group; every wait goes
    through `groups.wait` (StepAborted when the generation's abort flag is set); a failure of
    the vote's wait raises VoteInterrupted with the gradients reduced and unclipped. `halt`:
    this worker's wish to stop after this step, summed into the vote (a callable is asked right
    then). `reducer`: the step's BucketReducer if buckets were launched in the backward (else new).
    `phases`: this worker's forward, backward and wait seconds of the step (or what reads them,
    right before the vote: an accelerator's timing events are waited for then); the vote carries
    three slots per plan node (tensor-parallel rank 0 fills its node's), 24 bytes a node, and
    every worker learns them all. `tied`: the model ties its embedding and head (tied.py): their
    reduced gradients are summed before the norm, which counts the matrix once.
    """
    # 1. Cross-pipeline bucket reduction: launch what the backward did not, wait for all.
    if reducer is None:
        reducer = BucketReducer(accum=accum, layout=layout, groups=groups, layer_of=layer_of)
    reducer.launch_all()
    reducer.wait()

    if tied:
        sum_tied_grads(accum, layout=layout, groups=groups)

    # 2. Global norm (each element once), loss and the ok flag in one world all-reduce.
    sq = _my_sum_of_squares(accum, reducer, layout, tied=tied)
    device = sq.device
    loss_t = torch.as_tensor(loss_sum, dtype=torch.float64, device=device)
    failed = (~torch.isfinite(loss_t)).to(torch.float64) if ok else torch.ones((), dtype=torch.float64, device=device)
    nodes = layout.plan.nodes
    wish = halt() if callable(halt) else halt
    flags = torch.tensor([1.0 if wish else 0.0], dtype=torch.float64)
    stats = torch.cat([torch.stack([sq, loss_t, failed]), torch.cat([flags, _phase_slots(layout, phases)]).to(device)])
    try:
        groups.wait(groups.world.all_reduce(stats))
        total_sq, loss, failures, halts, *timed_all = groups.fetch(stats).tolist()
    except Exception as exc:
        raise VoteInterrupted(f"the vote's wait failed: {type(exc).__name__}: {exc}") from exc
    norm = math.sqrt(total_sq)
    usable = failures == 0 and math.isfinite(norm)

    # 3. Clip by one factor everywhere.
    if usable:
        clip_grads(accum, grad_norm=norm, grad_clip=grad_clip)
    seconds = {n: StepPhases(*timed_all[3 * i : 3 * i + 3]) for i, n in enumerate(nodes)}
    return GradStats(grad_norm=norm, loss=loss, ok=usable, halt=halts > 0, phases=seconds)


def _my_sum_of_squares(accum: GradAccumulator, reducer: BucketReducer, layout: ParallelLayout, *,
                       tied: bool) -> torch.Tensor:
    """This worker's part of the global norm's sum of squares (float64, on the gradients' device):
    each element of the model counted by one worker (module doc, step 2); with `tied`, the head's
    copy of the tied matrix by none, and the buckets the tied sum changed after their exchange
    measured them measured again."""
    grads, params = accum.grads, dict(accum.named)
    device = next(iter(grads.values())).device
    sq = torch.zeros((), dtype=torch.float64, device=device)
    wide = accum.scratch.get((-1, "norm", 0))
    if wide is None and device.type == "cpu":
        wide = accum.scratch[(-1, "norm", 0)] = torch.empty(_NORM_CHUNK, dtype=torch.float64, device=device)
    for bucket, names in reducer.buckets:
        if not names:
            continue
        k = accum.group_of(names[0])
        changed = tied and any(n in (EMBEDDING, HEAD) for n in names)
        measured = None if changed else reducer.measured.get(k)
        if measured is not None:  # my slice, measured by the exchange (every holder adds its own)
            sq += measured
            continue
        if not layout.counts_layer_for_norm(bucket.layers[0]):
            continue
        if layout.tp_rank == 0 and not changed:
            sq += sum_of_squares(accum.reduced[k], wide)
            continue
        for name in names:
            counted = _counted_part(params[name], grads[name], layout)
            if counted is not None and not (tied and name == HEAD):
                sq += sum_of_squares(counted, wide)
    return sq


def _counted_part(param: torch.Tensor, grad: torch.Tensor, layout: ParallelLayout) -> torch.Tensor | None:
    """What of a parameter's gradient this tensor-parallel rank counts in the norm: a replicated
    parameter's on rank 0 only, a shared key/value head's on its first replica only
    (model/kv_layout.py), every other shard whole."""
    if getattr(param, "tp_dim", None) is None:
        return grad if layout.tp_rank == 0 else None
    kv = getattr(param, "tp_layout", None)
    return grad if kv is None else kv.unique_rows(grad, layout.tp_rank, layout.tp_size)


def counted_span(param: torch.Tensor, layout: ParallelLayout) -> tuple[int, int]:
    """The elements of `param`'s flattened gradient this tensor-parallel rank counts in the norm
    (`_counted_part`'s, always a leading run): what the sharded optimizer's exchange measures."""
    with torch.no_grad():  # the parameter itself: its tensor-parallel attributes say what counts
        part = _counted_part(param, param, layout)
    return 0, 0 if part is None else part.numel()


def _phase_slots(layout: ParallelLayout, phases: StepPhases | Callable[[], StepPhases]) -> torch.Tensor:
    """The vote's three slots per plan node (forward, backward, wait), this node's filled on its
    tensor-parallel rank 0 (read there, right before the vote), every other slot 0."""
    nodes = layout.plan.nodes
    timed = torch.zeros((len(nodes), 3), dtype=torch.float64)
    if layout.tp_rank == 0:
        mine = phases() if callable(phases) else phases
        timed[nodes.index(layout.node)] = torch.tensor(mine.values(), dtype=torch.float64)
    return timed.flatten()


def clip_grads(accum: GradAccumulator, *, grad_norm: float, grad_clip: float) -> None:
    """Scale every reduced gradient by the clip factor of `grad_norm` (the same everywhere)."""
    if grad_clip > 0 and grad_norm > grad_clip:
        coef = grad_clip / (grad_norm + 1e-6)
        for reduced in accum.reduced:
            reduced.mul_(coef)


_NORM_CHUNK = 1 << 18
"""Elements widened to float64 at a time for a sum of squares (a 2 MiB scratch)."""
