"""AdamW over fp32 master weights, and the warmup + cosine learning-rate schedule.

Parameters are kept in fp32 at all times; lower precision exists only inside autocast regions
of the forward pass (bf16 on CUDA). The optimizer (adamw.py) therefore updates the fp32 master
copy directly, and its moments are fp32 too.

The learning rate is a pure function of the step number, set on the optimizer before each
update, so a replayed or migrated step needs no scheduler state.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from elastic.engine.adamw import MasterAdamW, ParamState
from elastic.records.optim_config import OptimConfig, lr_at

__all__ = ["OptimConfig", "build_optimizer", "lr_at"]


def build_optimizer(
    module: torch.nn.Module, cfg: OptimConfig, *, state: dict[str, ParamState] | None = None,
    owned: Mapping[str, tuple[int, int]] | None = None,
) -> MasterAdamW:
    """AdamW over `module`'s parameters (fp32: they are the master weights), keyed by name;
    `state` (by name) is adopted as it is, the rest starts from zero moments. `owned`: the
    sharded optimizer's ranges (`MasterAdamW`)."""
    return MasterAdamW(
        list(module.named_parameters()), betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, state=state,
        owned=owned,
    )
