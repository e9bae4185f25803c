"""A worker's links in its pipeline for one generation: who it receives from and sends to, in
what shape and parts, and the actions of its schedule (1F1B, or interleaved with v > 1).

Shared by the training step (step.py) and evaluation (eval.py), so both run the same chunks
over the same ring.
"""

from __future__ import annotations

import torch

from elastic.engine.device import wire_dtype
from elastic.parallel import plan_ranks
from elastic.parallel.executor import Gather, StageSpec, boundary_shape
from elastic.parallel.groups import ParallelGroups
from elastic.parallel.interleaved import interleaved
from elastic.parallel.layout import ParallelLayout
from elastic.parallel.schedule import Action, Op, forward_only


def stage_spec(
    layout: ParallelLayout, module: torch.nn.Module, *, batch: int, seq_len: int, d_model: int,
    device: torch.device, split: int = 1,
) -> StageSpec:
    """My place in my pipeline: with v > 1 chunks the first and last stages close a ring;
    `split`: parts each boundary tensor travels in (scatter/gather, `JobSpec.boundary_split`)."""
    pipe = layout.plan.pipelines[layout.pipeline]
    ring = pipe.virtual_stages > 1
    prev, nxt = layout.prev_rank, layout.next_rank
    if ring and prev is None:
        prev = plan_ranks.rank_of(layout.plan, layout.pipeline, layout.num_stages - 1, layout.tp_rank)
    if ring and nxt is None:
        nxt = plan_ranks.rank_of(layout.plan, layout.pipeline, 0, layout.tp_rank)
    return StageSpec(
        rank=layout.rank, prev_rank=prev, next_rank=nxt,
        act_shape=boundary_shape(module, batch, seq_len, d_model), act_dtype=wire_dtype(device),
        chunks=pipe.virtual_stages, first_stage=layout.is_first_stage, last_stage=layout.is_last_stage,
        split=split, part=layout.tp_rank,
    )


def stage_actions(layout: ParallelLayout, microbatches: int, *, train: bool = True) -> list[Action]:
    """My schedule over `microbatches`: 1F1B or interleaved 1F1B, or for evaluation
    (`train=False`) forwards only (with chunks: the interleaved order without its backwards)."""
    v = layout.plan.pipelines[layout.pipeline].virtual_stages
    if v == 1 and not train:
        return forward_only(num_stages=layout.num_stages, stage=layout.stage, microbatches=microbatches)
    actions = interleaved(num_stages=layout.num_stages, stage=layout.stage, microbatches=microbatches, chunks=v)
    if train:
        return actions
    return [a for a in actions if a.op not in (Op.BACKWARD, Op.RECV_GRAD, Op.SEND_GRAD)]


def tp_gather(groups: ParallelGroups) -> Gather:
    """Rebuild a flat boundary tensor from every tensor-parallel rank's part (scatter/gather)."""

    def gather(part: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(part) for _ in range(groups.tp.size)]
        groups.tp.all_gather(parts, part)
        return torch.cat(parts)

    return gather


__all__ = ["stage_actions", "stage_spec", "tp_gather"]
