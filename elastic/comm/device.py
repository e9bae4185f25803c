"""The calling thread's device and stream: the one place in `comm` that names CUDA.

NCCL and CUDA work per thread: every thread that posts, waits or computes on a worker's GPU
binds it first (`bind_thread`), and a thread that waits on communication for another thread
(the gradient exchange) runs on a stream of its own (`side_stream`), joined to the training
thread's stream by events (`mark`, `wait_mark`), so that its waits never hold up the training
thread's kernels. On CPU every function here is free and does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


def bind_thread(device: torch.device) -> None:
    """Make `device` the calling thread's current device (CUDA); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def synchronize(device: torch.device) -> None:
    """Wait until every kernel queued on `device` is done (CUDA); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


SIDE_STREAM_PRIORITY = -1
"""The priority of a side stream: high. torch hands streams out of a pool per priority, round
robin, so a stream of the default priority can be one that another user holds, ProcessGroupNCCL's
among them (its options ask for low priority: `opening.py`). A high-priority stream never is."""


def side_stream(device: torch.device) -> Any:
    """A stream of `device` for one thread's waits (CUDA; high priority, so never one of NCCL's
    streams: SIDE_STREAM_PRIORITY), None on CPU."""
    return torch.cuda.Stream(device=device, priority=SIDE_STREAM_PRIORITY) if device.type == "cuda" else None


@contextlib.contextmanager
def on_stream(stream: Any) -> Iterator[None]:
    """Run the block on `stream` (None: the current one)."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield


def mark(device: torch.device) -> Any:
    """An event recorded now on the calling thread's current stream (None on CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def wait_mark(event: Any) -> None:
    """Make the calling thread's current stream wait for `event` (None: nothing)."""
    if event is not None:
        torch.cuda.current_stream().wait_event(event)


def to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], bool]]:
    """A host copy of `tensor` and a test of whether it is complete: on CUDA a copy into pinned
    memory queued behind the current stream (the host does not block: poll the test), on CPU
    the tensor itself, complete at once."""
    if tensor.device.type != "cuda":
        return tensor, _done
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event.query


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor` that the caller may keep: on CUDA into pinned memory, queued
    behind the current stream (the host does not block: `mark` after the copies, and `settle`
    the mark before reading them), on CPU a plain copy."""
    if tensor.device.type != "cuda":
        return tensor.detach().to(device="cpu", copy=True)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor.detach(), non_blocking=True)
    return host


def settle(event: Any) -> None:
    """Block the calling thread until `event` (a `mark`) has happened (None: at once)."""
    if event is not None:
        event.synchronize()


def _done() -> bool:
    return True
