"""What every baseline trains: the same GPT, data order, loss and AdamW settings as the engine.

A step `s` (1-based, as the runtime prints it) consumes `step_sample_indices(s - 1, global_batch)`;
each data-parallel rank takes a contiguous slice of it and averages its microbatches' losses, so
the all-reduced gradient is that of the mean loss over the global batch, as in the engine.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from elastic.data.dataset import TokenDataset, step_sample_indices
from elastic.engine.optim import OptimConfig, lr_at
from elastic.model.config import get_preset
from elastic.model.gpt import GPTStage

OPTIM = OptimConfig(eps=1e-6)
"""The optimizer settings of bench/recovery.py's elastic runs."""


class StepOptimizer(Protocol):
    """What train_step needs of an optimizer (torch's, or a wrapper that decides the commit)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def step(self) -> None: ...


def build(model: str) -> tuple[GPTStage, torch.optim.AdamW, TokenDataset]:
    """The whole model (one stage), torch AdamW with the engine's decay groups, and the data."""
    cfg = get_preset(model)
    net = GPTStage(cfg)
    decay = [p for p in net.parameters() if p.dim() >= 2]
    no_decay = [p for p in net.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": OPTIM.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
    )
    return net, optimizer, TokenDataset(seq_len=cfg.seq_len)


def train_step(
    model: torch.nn.Module,
    stage: GPTStage,
    optimizer: StepOptimizer | torch.optim.Optimizer,
    data: TokenDataset,
    *,
    step: int,
    rank: int,
    world: int,
    global_batch: int,
    microbatch: int,
    no_sync: Any = None,
) -> float:
    """One optimizer step (1-based `step`) of this rank; returns its local mean loss.

    `model` is the (possibly DDP-wrapped) module called for the forward pass, `stage` the plain
    GPTStage (for its loss), `no_sync` a context-manager factory that skips gradient
    synchronisation on all but the last microbatch (DDP's `no_sync`), or None.
    """
    per_rank = global_batch // world
    local_mbs = per_rank // microbatch
    samples = step_sample_indices(step - 1, global_batch)[rank * per_rank : (rank + 1) * per_rank]
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for m in range(local_mbs):
        x, y = data.batch(samples[m * microbatch : (m + 1) * microbatch])
        last = m == local_mbs - 1
        with contextlib.nullcontext() if last or no_sync is None else no_sync():
            loss = stage.loss(model(x, dropout_key=m), y) / local_mbs
            loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step - 1, OPTIM)
    optimizer.step()
    return total


def append_event(path: Path, **event: Any) -> None:
    """Append one JSON line (with the wall time `t`) to an event log shared by processes."""
    event.setdefault("t", time.time())
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")
        f.flush()


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
