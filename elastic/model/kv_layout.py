"""Grouped-query attention's fused `attn.qkv` rows across tensor-parallel ranks, replicated key/value
heads included.

The canonical rows are group-major (model/llama.py): for each of the `groups` key/value groups,
its `queries` query heads, then its key head, then its value head, `head_dim` rows each. At a
degree t that divides `groups`, rank r holds groups [r g/t, (r+1) g/t): one contiguous chunk,
as every other column-parallel weight. At a degree that `groups` divides (t = g m, m > 1, and m
divides `queries`), each group is shared by m ranks ("replicas"): rank r holds group r // m,
its query heads [(r % m) q/m, (r % m + 1) q/m) and the group's key and value heads. That is a
contiguous chunk of the *expanded* rows, in which every group is written out m times, each copy
with its m-th of the queries and the whole key and value: `expand` writes those rows, `collapse`
(the inverse) reads the canonical tensor back from them, taking each key/value head from its
first replica. Global query head h stays on rank h t / n_head, as without replication, so
attention dropout's per-head masks select the same heads.

The replicas of a key/value head compute with the same weights (and, with `qkv_bias`, biases);
their gradients are summed over the replicas in the backward (`sum_replica_grads`) so that every
replica holds the whole gradient, takes the same optimizer step and stays identical. The gradient norm counts a
replicated head once (`unique_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from elastic.model.config import GPTConfig, kv_replicas, qkv_shard_rows
from elastic.model.tensor_parallel import TensorParallel


@dataclass(frozen=True, kw_only=True)
class KvGroups:
    """The group-major structure of a fused qkv tensor's first dimension (module doc)."""

    groups: int
    """Key/value heads (n_kv_heads)."""
    queries: int
    """Query heads per key/value head (n_head / n_kv_heads)."""
    head_dim: int

    @classmethod
    def of(cls, cfg: GPTConfig) -> KvGroups:
        return cls(groups=cfg.kv_heads, queries=cfg.n_head // cfg.kv_heads, head_dim=cfg.head_dim)

    def replicas(self, size: int) -> int:
        """Ranks that share each key/value head at degree `size` (1: none; `config.kv_replicas`)."""
        return kv_replicas(self.groups, self.groups * self.queries, size)

    def local_groups(self, size: int) -> int:
        """Key/value heads each rank holds at degree `size`."""
        return max(1, self.groups // size)

    def local_queries(self, size: int) -> int:
        """Query heads per held key/value head at degree `size`."""
        return self.queries // self.replicas(size)

    def local_rows(self, size: int) -> int:
        """Rows of one rank's shard at degree `size` (`config.qkv_shard_rows`)."""
        return qkv_shard_rows(self.groups, self.groups * self.queries, self.head_dim, size)

    def expand(self, full: torch.Tensor, size: int) -> torch.Tensor:
        """The rows of every rank at degree `size`, in rank order (the canonical `full` itself
        without replication)."""
        m = self.replicas(size)
        if m == 1:
            return full
        rest, hd, q = full.shape[1:], self.head_dim, self.queries
        grouped = full.reshape(self.groups, q + 2, hd, *rest)
        queries = grouped[:, :q].reshape(self.groups, m, q // m, hd, *rest)
        kv = grouped[:, q:].unsqueeze(1).expand(self.groups, m, 2, hd, *rest)
        return torch.cat((queries, kv), dim=2).reshape(-1, *rest)

    def collapse(self, expanded: torch.Tensor, size: int) -> torch.Tensor:
        """The canonical tensor from the rows of every rank at degree `size` (`expand`'s inverse)."""
        m = self.replicas(size)
        if m == 1:
            return expanded
        rest, hd, q = expanded.shape[1:], self.head_dim, self.queries
        ranks = expanded.reshape(self.groups, m, q // m + 2, hd, *rest)
        queries = ranks[:, :, : q // m].reshape(self.groups, q, hd, *rest)
        return torch.cat((queries, ranks[:, 0, q // m :]), dim=1).reshape(-1, *rest)

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank `rank`'s rows of the canonical `full` at degree `size`."""
        rows = self.local_rows(size)
        return self.expand(full, size)[rank * rows : (rank + 1) * rows]

    def unique_rows(self, shard: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """The rows of `shard` that no lower rank also holds: all but a replicated key/value head's
        on every replica after its first (what a gradient norm counts)."""
        m = self.replicas(size)
        if m == 1 or rank % m == 0:
            return shard
        return shard[: self.local_queries(size) * self.head_dim]


class _SumReplicaGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, layout: KvGroups, tp: TensorParallel) -> torch.Tensor:
        ctx.layout, ctx.tp = layout, tp
        return weight.view_as(weight)  # the parameter's own storage: nothing kept

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        layout, tp = ctx.layout, ctx.tp
        m, q_rows = layout.replicas(tp.size), layout.local_queries(tp.size) * layout.head_dim
        mine = tp.rank // m
        # Each rank writes its key/value gradient in its group's slot; the sum over the group's
        # replicas is one all-reduce on the tensor-parallel communicator (zeros elsewhere).
        slots = grad.new_zeros((layout.groups, *grad[q_rows:].shape))
        slots[mine] = grad[q_rows:]
        tp.all_reduce(slots)
        return torch.cat((grad[:q_rows], slots[mine])), None, None


def sum_replica_grads(weight: torch.Tensor, layout: KvGroups, tp: TensorParallel) -> torch.Tensor:
    """`weight` (this rank's qkv rows) for use in the forward: where key/value heads are
    replicated, their gradient is summed over the replicas in the backward (module doc)."""
    if tp.size == 1 or layout.replicas(tp.size) == 1:
        return weight
    return _SumReplicaGrads.apply(weight, layout, tp)
