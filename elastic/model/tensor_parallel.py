"""The tensor-parallel context a model is built with: one explicit communicator, no globals."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastic.comm import Communicator, Handle
from elastic.model.config import tp_split


@dataclass(frozen=True, kw_only=True)
class TensorParallel:
    """Which tensor-parallel shard this process holds, and the communicator that joins the shards."""

    group: Communicator | None = None
    """Communicator of the tensor-parallel peers; None only when size == 1."""
    rank: int = 0
    """This process's rank inside the tensor-parallel group."""
    size: int = 1
    """Tensor-parallel degree (number of shards)."""
    wait: Callable[[Handle], None] | None = None
    """How the collectives wait for their operations; None means `handle.wait()`. The runtime
    passes an abortable wait here, so the model itself stays failure-agnostic."""

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")
        if self.size > 1 and self.group is None:
            raise ValueError(f"tensor-parallel degree {self.size} needs a process group")

    @classmethod
    def single(cls) -> TensorParallel:
        """No tensor parallelism: every collective is a no-op."""
        return cls()

    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        """All-reduce `x` in place over the tensor-parallel group, and wait for it."""
        assert self.group is not None
        self._complete(self.group.all_reduce(x, op=op))

    def all_gather(self, parts: list[torch.Tensor], x: torch.Tensor) -> None:
        """Gather every rank's `x` into `parts`, and wait for it."""
        assert self.group is not None
        self._complete(self.group.all_gather(parts, x))

    def reduce_scatter(self, output: torch.Tensor, x: torch.Tensor) -> None:
        """Sum every rank's `x` and keep chunk `rank` of its first dimension in `output`, and wait."""
        assert self.group is not None
        self._complete(self.group.reduce_scatter(output, x))

    def _complete(self, work: Handle) -> None:
        if self.wait is None:
            work.wait()
        else:
            self.wait(work)

    def divide(self, value: int, what: str) -> int:
        """value / size, with a clear error when it does not divide (`config.tp_split`)."""
        return tp_split(value, self.size, what)
