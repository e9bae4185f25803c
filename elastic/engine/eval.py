"""Validation loss on the held-out split, with the committed parameters, in the pipeline engine.

An evaluation is K held-out microbatches (`held_out_batch` of the dataset: samples no training
step sees). Every pipeline of the generation evaluates a contiguous share of them with an
all-forward schedule (`schedule.forward_only`: no gradient, dropout off, nothing kept for a
backward), its last stage's tensor-parallel rank 0 adds its microbatch losses divided by K, and
one float64 world all-reduce sums the shares: the same reduction the step's training loss takes
(`finalize_grads`' vote). Microbatch k always holds held-out samples [k*B, (k+1)*B) with B the
job's microbatch size, so the value does not depend on the plan, the TP degree, the number of
pipelines or a recovery (TP degrees agree to ~1e-6, as their training losses do).

Collective over the generation's world group: every worker of the generation calls `evaluate`
at the same step boundary, and every wait goes through the groups' abort flag, so a failure during
an evaluation ends it like a failure during a step (nothing is committed by an evaluation; the
next generation evaluates again).
"""

from __future__ import annotations

import torch

from elastic.data.dataset import TokenDataset
from elastic.engine.device import compute_precision
from elastic.engine.stage_links import stage_actions, stage_spec
from elastic.parallel.executor import MicrobatchResult, run_schedule
from elastic.parallel.groups import ParallelGroups
from elastic.parallel.layout import ParallelLayout


def eval_due(committed: int, *, every: int, steps: int) -> bool:
    """Whether an evaluation follows `committed` committed steps: every `every` steps and after
    the job's last (`every` 0: never)."""
    return every > 0 and committed > 0 and (committed % every == 0 or committed == steps)


def pipeline_share(pipeline: int, pipelines: int, batches: int) -> range:
    """The held-out microbatches pipeline `pipeline` of `pipelines` evaluates: contiguous, sizes
    differing by at most one (a pipeline may get none when batches < pipelines)."""
    if not 0 <= pipeline < pipelines:
        raise ValueError(f"pipeline {pipeline} outside {pipelines} pipelines")
    return range(pipeline * batches // pipelines, (pipeline + 1) * batches // pipelines)


def evaluate(
    module: torch.nn.Module,
    *,
    layout: ParallelLayout,
    groups: ParallelGroups,
    dataset: TokenDataset,
    batches: int,
    batch_size: int,
    d_model: int,
    device: torch.device,
) -> float:
    """Mean loss over held-out microbatches [0, `batches`) of `batch_size` samples each, with
    `module`'s current parameters (module doc). Collective over `groups.world`; StepAborted when
    the generation's abort flag is set during it. The module's training mode is restored."""
    if batches < 1:
        raise ValueError(f"an evaluation needs at least one batch, got {batches}")
    mine = pipeline_share(layout.pipeline, len(layout.plan.pipelines), batches)
    losses = MicrobatchResult()
    if len(mine):
        losses = _run_share(module, mine, layout=layout, groups=groups, dataset=dataset,
                            batch_size=batch_size, d_model=d_model, device=device)
    counted = layout.is_last_stage and layout.tp_rank == 0
    total = (losses.loss_sum(device) / batches if counted else torch.zeros((), dtype=torch.float64, device=device))
    total = total.reshape(1)
    groups.wait(groups.world.all_reduce(total))
    return float(groups.fetch(total)[0])  # a non-finite loss is reported as it is: every worker sees the same


def _run_share(
    module: torch.nn.Module, mine: range, *, layout: ParallelLayout, groups: ParallelGroups, dataset: TokenDataset,
    batch_size: int, d_model: int, device: torch.device,
) -> MicrobatchResult:
    """Forward this pipeline's held-out microbatches through my stage; local index -> loss (on a
    last stage)."""
    spec = stage_spec(layout, module, batch=batch_size, seq_len=dataset.seq_len, d_model=d_model, device=device)
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        if m not in cache:
            k = mine[m]
            cache[m] = dataset.held_out_batch(range(k * batch_size, (k + 1) * batch_size))
        return cache[m]

    actions = stage_actions(layout, len(mine), train=False)
    was_training = module.training
    module.eval()  # no dropout
    try:
        with torch.no_grad():
            result = run_schedule(
                module, actions, spec=spec, group=groups.world, wait=groups.wait, post=groups.p2p, device=device,
                tokens=lambda m: batch(m)[0], targets=lambda m: batch(m)[1], loss_scale=1.0,
                dropout_key=lambda m: 0, autocast=lambda: compute_precision(device), forward_only=True,
            )
    finally:
        module.train(was_training)
    return result
