"""Tied input and output embeddings (`GPTConfig.tie_embeddings`) across pipeline stages.

The token embedding (planning layer 0, `embed.wte.weight`) and the output head's weight (the last
planning layer, `head.lm_head.weight`) are one matrix in the model. As in Megatron, each stage
that uses it keeps a copy: both start from the same value (model/init.py gives the head the
embedding's initial value), and after the step's cross-pipeline reduction each copy's gradient
is replaced by the sum of both (`sum_tied_grads`). Every copy then takes the same optimizer
step from the same gradient and stays bit for bit equal to the other, so the runtime needs
nothing else: checkpoints, shard moves and the sharded optimizer treat the copy as any other
parameter.

Within a pipeline the worker holding layer 0 and the one holding the head (same tensor-parallel
rank, so the same vocabulary rows) exchange their reduced gradients point to point on the world
communicator and each adds the other's: a + b on one side, b + a on the other, equal bits.
Where one worker holds both (a pipeline of one stage), it adds them itself. The result is the
same bits on every plan. The global gradient norm counts the matrix once: the head's copy is
left out of it (grad_sync.py): HEAD's copy.
"""

from __future__ import annotations

import torch

from elastic.comm import P2P
from elastic.model.naming import EMBEDDING, HEAD
from elastic.parallel import plan_ranks
from elastic.parallel.grad_accum import GradAccumulator
from elastic.parallel.groups import ParallelGroups
from elastic.parallel.layout import ParallelLayout

TIED_TAG = 1 << 23
"""The exchange's tag on the world communicator: apart from the activations', the kept sums'
(elastic/engine/replay_sums.py) and the sharded optimizer's gather (1 << 24 and up)."""


def partner(layout: ParallelLayout, layer: int) -> int:
    """Global rank of the worker of my pipeline and tensor-parallel rank that holds `layer`."""
    for s, stage in enumerate(layout.plan.pipelines[layout.pipeline].stages):
        if stage.holds(layer):
            return plan_ranks.rank_of(layout.plan, layout.pipeline, s, layout.tp_rank)
    raise ValueError(f"pipeline {layout.pipeline} holds no layer {layer}")


def sum_tied_grads(accum: GradAccumulator, *, layout: ParallelLayout, groups: ParallelGroups) -> None:
    """Replace the reduced gradient of each copy of the tied matrix I hold by the sum of both
    copies' (module doc). Collective with my pipeline's holder of the other copy; its wait goes
    through `groups.wait` (StepAborted when the generation's abort flag is set)."""
    grads = accum.grads
    mine = [name for name in (EMBEDDING, HEAD) if name in grads]
    if len(mine) == 2:
        total = grads[EMBEDDING] + grads[HEAD]
        grads[EMBEDDING].copy_(total)
        grads[HEAD].copy_(total)
        return
    if not mine:
        return
    (name,) = mine
    other = layout.plan.num_layers - 1 if name == EMBEDDING else 0
    peer = partner(layout, other)
    theirs = torch.empty_like(grads[name])
    groups.wait(groups.p2p([P2P(kind="send", tensor=grads[name], peer=peer, tag=TIED_TAG),
                            P2P(kind="recv", tensor=theirs, peer=peer, tag=TIED_TAG)]))
    grads[name].add_(theirs)
