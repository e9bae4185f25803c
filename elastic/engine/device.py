"""Device, collective backend and precision selection: the one place that names an accelerator.

Device of a worker: accelerator `base + local_rank` of its host, where `base` is the node's
first device on that host (`ELASTIC_DEVICE_BASE`, set by the launcher for each simulated node
it starts on one host, so that every node gets GPUs of its own: NCCL refuses two ranks of one
communicator on one GPU; 0 for an agent started alone on its host). The worker binds it as its
current device (`bind`), and so does every thread of its that touches the GPU.

Precision (docs/numerics.md, "Precision"): parameters, gradients and optimizer state are float32 master
copies; on CUDA the forward and backward run under bf16 autocast and stage activations travel
in bf16; the loss is computed in float32 at least (float64 for a float64 model); on CPU
everything is float32, so results match across plans bit for bit.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from elastic.comm.device import bind_thread
from elastic.records.job import DEVICE_BASE_ENV


def select_device(local_rank: int, *, want: str = "auto", base: int | None = None) -> torch.device:
    """The device of worker `local_rank` of a node: accelerator `base + local_rank` when there
    is one (and `want` is "auto" or "cuda"), else the CPU. `base` defaults to
    $ELASTIC_DEVICE_BASE (0 when unset). ValueError when the host has too few accelerators."""
    if want not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {want!r}")
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    if base is None:
        raw = os.environ.get(DEVICE_BASE_ENV, "0")
        try:
            base = int(raw)
        except ValueError:
            raise ValueError(f"${DEVICE_BASE_ENV} must be a device index, got {raw!r}") from None
    index, count = base + local_rank, torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(
            f"worker {local_rank} of a node whose first device is {base} needs device {index}, but this host has "
            f"{count}: run fewer simulated nodes per host, or fewer workers per node"
        )
    return torch.device("cuda", index)


def bind(device: torch.device) -> None:
    """Make `device` the calling thread's current device (CUDA; nothing on CPU): before its
    first CUDA call, or a thread without it works on device 0 (a context there, and NCCL's
    "Duplicate GPU" when two workers of a host do)."""
    bind_thread(device)


def backend_for(device: torch.device) -> str:
    """Collective backend for tensors living on `device`."""
    return "nccl" if device.type == "cuda" else "gloo"


def wire_dtype(device: torch.device) -> torch.dtype:
    """Dtype of stage activations (and their gradients) between stages: the autocast dtype on
    CUDA (half the bytes of float32), float32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@contextlib.contextmanager
def compute_precision(device: torch.device) -> Iterator[None]:
    """bf16 autocast on CUDA; full fp32 elsewhere (CPU results must match across plans)."""
    if device.type == "cuda":
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            yield
    else:
        yield
