"""Create the process groups a ParallelLayout names, fresh for each generation.

No default process group is used (it cannot be re-initialised in a live process). Each group
is a backend process group built directly on a store prefix of its own,
`generation/<g>/group/<ranks>`, so groups of different generations never share store keys.
Building a group is a rendezvous of its members only: a worker builds just the groups it is a
member of, in the single order of `layout.all_group_ranks()` (world first), so two workers
never wait for each other in opposite orders. Peers are addressed by their rank inside a
group; in the world group that is the layout's global rank.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist

from elastic.model.tensor_parallel import TensorParallel
from elastic.parallel.abort import AbortSignal, call_abortable, wait_work
from elastic.parallel.layout import ParallelLayout
from elastic.parallel.retire import close_group


@dataclass(frozen=True, kw_only=True)
class ParallelGroups:
    """The process groups one worker uses in one generation."""

    world: dist.ProcessGroup
    """Every worker of the generation (p2p between stages, step agreement, grad norm, loss)."""
    tp: TensorParallel
    """My tensor-parallel context (group of my node's workers)."""
    buckets: dict[tuple[int, ...], dist.ProcessGroup | None]
    """Gradient-bucket group for each holder rank set of mine; None for a set of one."""
    abort: AbortSignal | None = None
    """The generation's abort flag every cross-worker wait of a step checks; None: plain waits."""
    store: dist.Store | None = None
    """The store the groups were built on, held as long as they live: a group keeps only the C++
    side of a Python store (pytorch#115977), so a lazily connecting group (TORCH_GLOO_LAZY_INIT=1)
    whose caller dropped a temporary store would fail its first collective ("pure virtual
    Store::wait"). `build_groups` fills it."""

    connected: set[int] = field(default_factory=set)
    """World ranks a point-to-point operation was posted to already."""

    def p2p(self, op: str, tensor: torch.Tensor, peer: int, tag: int, *, local: bool = False) -> dist.Work:
        """Post `op` ("send" or "recv") of `tensor` with world rank `peer`. The first operation
        with a peer connects to it inside the call (gloo's lazy pairs), which a dead peer would
        block until the group's timeout: that one is posted abortably (`call_abortable`; with
        `local`, as a wait inside my pipeline)."""
        if op == "send":
            post = functools.partial(dist.isend, tensor, group=self.world, group_dst=peer, tag=tag)
        elif op == "recv":
            post = functools.partial(dist.irecv, tensor, group=self.world, group_src=peer, tag=tag)
        else:
            raise ValueError(f"op must be 'send' or 'recv', got {op!r}")
        if peer in self.connected:
            work = post()
        else:
            work = call_abortable(post, self.abort, local=local)
            self.connected.add(peer)
        assert work is not None
        return work

    def p2p_local(self, op: str, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        """`p2p` with a peer of my pipeline (a local abort lets it complete)."""
        return self.p2p(op, tensor, peer, tag, local=True)

    def close(self) -> None:
        """Close every connection of these groups, once retired (elastic/parallel/retire.py)."""
        for group in {id(g): g for g in (self.world, self.tp.group, *self.buckets.values()) if g is not None}.values():
            close_group(group)

    def bucket_group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        return self.buckets[ranks]

    def wait(self, work: dist.Work | None) -> None:
        """Wait for one operation of a step, abortably when the groups have an abort flag."""
        assert work is not None
        wait_work(work, self.abort)

    def wait_all(self, works: Sequence[dist.Work]) -> None:
        """`wait` for several operations at once: one hop to the abort's waiter thread at most
        (a point-to-point work reports completion only once waited for, so each `wait` of one
        would cost a hop of its own)."""
        if all(w.is_completed() for w in works):
            for w in works:
                self.wait(w)
            return
        call_abortable(lambda: [w.wait() for w in works], self.abort)

    def wait_local(self, work: dist.Work | None) -> None:
        """Wait for an operation inside my pipeline (a stage-to-stage transfer): a local abort
        (a failure in another pipeline) lets it complete, a hard one ends it."""
        assert work is not None
        wait_work(work, self.abort, local=True)


def new_group(
    store: dist.Store, *, rank: int, size: int, timeout: timedelta, backend: str
) -> dist.ProcessGroup:
    """A process group of `size` members on `store` (blocks until every member joined).

    The backend object is used as the group itself: the collective and p2p functions of
    torch.distributed accept it (measured with gloo on torch 2.13), and it needs no default
    group, which a live process could not re-create for a later generation.
    """
    if backend == "gloo":
        return cast(dist.ProcessGroup, dist.ProcessGroupGloo(store, rank, size, timeout))
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout  # the public constructor takes the timeout only through Options
        return cast(dist.ProcessGroup, dist.ProcessGroupNCCL(store, rank, size, options))
    raise ValueError(f"unsupported backend {backend!r} (gloo or nccl)")


def group_prefix(generation: int, ranks: tuple[int, ...] | None) -> str:
    """Store prefix of one group of one generation (None: the world group)."""
    name = "world" if ranks is None else "-".join(map(str, ranks))
    return f"generation/{generation}/group/{name}"


def build_groups(
    layout: ParallelLayout,
    store: dist.Store,
    *,
    timeout: timedelta,
    backend: str = "gloo",
    abort: AbortSignal | None = None,
) -> ParallelGroups:
    """Build every group of `layout` that this worker belongs to, world group included.

    The groups keep `store` referenced (`ParallelGroups.store`), so a caller may pass a
    temporary. Store calls: each group makes one `set` per member and one `wait` + `get` per
    peer it connects to (every member when gloo connects eagerly; with TORCH_GLOO_LAZY_INIT=1
    only the peers it talks to, on first use); nothing else (no `add`, no barrier).
    """

    def make(ranks: tuple[int, ...] | None) -> dist.ProcessGroup:
        members = tuple(range(layout.world_size)) if ranks is None else ranks
        return new_group(
            dist.PrefixStore(group_prefix(layout.generation, ranks), store),
            rank=members.index(layout.rank),
            size=len(members),
            timeout=timeout,
            backend=backend,
        )

    world = make(None)
    created: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for ranks in layout.all_group_ranks():
        if layout.rank in ranks:
            created[ranks] = make(ranks)
    tp_ranks = layout.tp_ranks
    # Tensor-parallel peers share my node, hence my pipeline: a local abort lets them finish.
    wait = None if abort is None else functools.partial(wait_work, abort=abort, local=True)
    tp = (
        TensorParallel(group=created[tp_ranks], rank=layout.tp_rank, size=layout.tp_size, wait=wait)
        if len(tp_ranks) > 1
        else TensorParallel.single()
    )
    buckets = {b.ranks: created.get(b.ranks) for b in layout.buckets}
    return ParallelGroups(world=world, tp=tp, buckets=buckets, abort=abort, store=store)
