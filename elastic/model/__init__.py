"""GPT with Megatron-style tensor parallelism. Knows nothing of failures, etcd or plans."""

from elastic.model.config import PRESETS, GPTConfig, get_preset
from elastic.model.gpt import GPTStage
from elastic.model.tensor_parallel import TensorParallel

__all__ = ["PRESETS", "GPTConfig", "GPTStage", "TensorParallel", "get_preset"]
