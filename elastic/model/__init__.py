"""GPT with Megatron-style tensor parallelism. Knows nothing of failures, etcd or plans.

`config` (presets, layer counts) is torch-free; the torch-based names below load on first use,
so that the planner's CLI starts without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from elastic.model.config import PRESETS, GPTConfig, get_preset

if TYPE_CHECKING:
    from elastic.model.gpt import GPTStage
    from elastic.model.tensor_parallel import TensorParallel

_LAZY = {"GPTStage": "elastic.model.gpt", "TensorParallel": "elastic.model.tensor_parallel"}

__all__ = ["PRESETS", "GPTConfig", "GPTStage", "TensorParallel", "get_preset"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'elastic.model' has no attribute {name!r}")
