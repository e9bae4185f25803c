"""One optimizer step as a transaction: it commits everywhere or changes nothing.

The step runs the pipeline schedule over this pipeline's slice of step s's global batch,
reduces gradients across pipelines, and agrees with every worker (one world all-reduce that
also carries the gradient norm and loss). Only then does it commit: set the learning rate of
step s, apply AdamW, advance the step counter. Any error before the commit (a peer that died,
a timeout, a non-finite gradient anywhere) discards the step: gradients are cleared, and the
parameters, optimizer moments and step counter are exactly as they were, so the same step can
be replayed with the same samples.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from elastic.data.dataset import TokenDataset, step_sample_indices
from elastic.parallel.executor import StageSpec, run_schedule
from elastic.parallel.grad_accum import GradAccumulator
from elastic.parallel.grad_sync import GradStats, bucket_plan, finalize_grads
from elastic.parallel.groups import ParallelGroups
from elastic.parallel.layout import ParallelLayout
from elastic.parallel.schedule import one_f_one_b
from elastic.runtime.adamw import MasterAdamW
from elastic.runtime.device import compute_precision
from elastic.runtime.optim import OptimConfig, lr_at


class StepDiscarded(RuntimeError):
    """A step that did not commit; the training state is unchanged."""


@dataclass(frozen=True, kw_only=True)
class StepReport:
    """What a committed step produced."""

    step: int
    """Index of the committed step."""
    loss: float
    """Mean loss over the global batch."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate applied."""
    seconds: float
    """Wall time of the step on this worker."""


def dropout_key(step: int, global_microbatch: int) -> int:
    """Dropout seed of one microbatch: a function of (step, global microbatch index) only, so
    masks do not depend on the plan."""
    return step * 1_000_003 + global_microbatch


class StepTransaction:
    """Runs steps of one worker's stage under one layout; holds no step counter of its own."""

    def __init__(
        self,
        *,
        module: torch.nn.Module,
        optimizer: MasterAdamW,
        layout: ParallelLayout,
        groups: ParallelGroups,
        dataset: TokenDataset,
        optim: OptimConfig,
        layer_of: Callable[[str], int],
        d_model: int,
        device: torch.device,
        grad_dtype: torch.dtype = torch.float64,
    ) -> None:
        self.module, self.optimizer = module, optimizer
        self.layout, self.groups = layout, groups
        self.dataset, self.optim, self.layer_of = dataset, optim, layer_of
        self.device = device
        names = [name for name, _ in module.named_parameters()]
        partition = [group for _, group in bucket_plan(names, layout, layer_of)]
        self.accum = GradAccumulator(module, dtype=grad_dtype, partition=partition)
        plan = layout.plan
        self.actions = one_f_one_b(
            num_stages=layout.num_stages, stage=layout.stage, microbatches=layout.num_microbatches
        )
        self.spec = StageSpec(
            rank=layout.rank,
            prev_rank=layout.prev_rank,
            next_rank=layout.next_rank,
            act_shape=(plan.microbatch_size, dataset.seq_len, d_model),
        )

    def _microbatch(self, step: int, local_mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self.layout.plan
        samples = step_sample_indices(step, plan.global_batch)
        g = self.layout.microbatch_offset + local_mb
        mbs = plan.microbatch_size
        return self.dataset.batch(samples[g * mbs : (g + 1) * mbs])

    def run(self, step: int) -> StepReport:
        """Run and commit step `step`; StepDiscarded (state unchanged) if it cannot commit."""
        start = time.perf_counter()
        self.optimizer.zero_grad()
        self.accum.zero()
        try:
            report = self._forward_backward_reduce(step)
        except Exception as exc:
            self.optimizer.zero_grad()
            raise StepDiscarded(f"step {step} discarded on rank {self.layout.rank}: {exc}") from exc
        if not report.ok:
            self.optimizer.zero_grad()
            raise StepDiscarded(
                f"step {step} discarded: a worker failed or the gradient norm is {report.grad_norm}"
            )
        # Commit: every worker got here with the same norm, loss and verdict.
        lr = lr_at(step, self.optim)
        self.optimizer.lr = lr
        self.accum.write_grads()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return StepReport(
            step=step,
            loss=report.loss,
            grad_norm=report.grad_norm,
            lr=lr,
            seconds=time.perf_counter() - start,
        )

    def _forward_backward_reduce(self, step: int) -> GradStats:
        layout = self.layout
        total_mbs = layout.plan.global_microbatches
        offset = layout.microbatch_offset
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
            if m not in cache:
                cache[m] = self._microbatch(step, m)
            return cache[m]

        result = run_schedule(
            self.module,
            self.actions,
            spec=self.spec,
            group=self.groups.world,
            device=self.device,
            tokens=lambda m: batch(m)[0],
            targets=lambda m: batch(m)[1],
            loss_scale=1.0 / total_mbs,
            dropout_key=lambda m: dropout_key(step, offset + m),
            autocast=lambda: compute_precision(self.device),
        )
        counted = layout.is_last_stage and layout.tp_rank == 0
        loss_sum = sum(result.losses.values()) / total_mbs if counted else 0.0
        finite = all(math.isfinite(v) for v in result.losses.values())
        return finalize_grads(
            self.accum,
            layout=layout,
            groups=self.groups,
            layer_of=self.layer_of,
            loss_sum=loss_sum,
            grad_clip=self.optim.grad_clip,
            ok=finite,
        )
