"""The tensor-parallel context a model is built with: one explicit group, no globals."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class TensorParallel:
    """Which tensor-parallel shard this process holds, and the group that joins the shards."""

    group: dist.ProcessGroup | None = None
    """Process group of the tensor-parallel peers; None only when size == 1."""
    rank: int = 0
    """This process's rank inside the tensor-parallel group."""
    size: int = 1
    """Tensor-parallel degree (number of shards)."""
    wait: Callable[[dist.Work], None] | None = None
    """How the collectives wait for their (async) operations; None means `work.wait()`. The
    runtime passes an abortable wait here, so the model itself stays failure-agnostic."""

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")
        if self.size > 1 and self.group is None:
            raise ValueError(f"tensor-parallel degree {self.size} needs a process group")

    @classmethod
    def single(cls) -> TensorParallel:
        """No tensor parallelism: every collective is a no-op."""
        return cls()

    @classmethod
    def from_group(cls, group: dist.ProcessGroup) -> TensorParallel:
        """The context of the calling process inside `group`."""
        return cls(group=group, rank=dist.get_rank(group), size=dist.get_world_size(group))

    def complete(self, work: dist.Work | None) -> None:
        """Wait for a collective launched with `async_op=True` on this group."""
        assert work is not None
        if self.wait is None:
            work.wait()
        else:
            self.wait(work)

    def divide(self, value: int, what: str) -> int:
        """value / size, with a clear error when it does not divide."""
        if value % self.size:
            raise ValueError(f"{what}={value} is not divisible by the tensor-parallel degree {self.size}")
        return value // self.size
