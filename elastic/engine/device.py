"""Device and collective-backend selection: the one place that names an accelerator."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def select_device(local_rank: int, *, want: str = "auto") -> torch.device:
    """The device of worker `local_rank` of a node: its own accelerator when there is one
    (and `want` is "auto" or "cuda"), else the CPU."""
    if want not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {want!r}")
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    count = torch.cuda.device_count()
    return torch.device("cuda", local_rank % count)


def backend_for(device: torch.device) -> str:
    """Collective backend for tensors living on `device`."""
    return "nccl" if device.type == "cuda" else "gloo"


@contextlib.contextmanager
def compute_precision(device: torch.device) -> Iterator[None]:
    """bf16 autocast on CUDA; full fp32 elsewhere (CPU results must match across plans)."""
    if device.type == "cuda":
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            yield
    else:
        yield
