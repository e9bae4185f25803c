"""Create the communicators a ParallelLayout names, fresh for each generation.

No default process group is used (it cannot be re-initialised in a live process). Each group
is a communicator (elastic/comm/communicator.py: a real `dist.ProcessGroup`, NCCL bound to the
device and connected at once) built on a store prefix of its own, `generation/<g>/group/<ranks>`,
so groups of different generations never share store keys. Building a group is a rendezvous of
its members only: a worker builds just the groups it is a member of, in the single order of
`plan_ranks.all_group_ranks(plan)` (world first), so two workers never wait for each other in opposite
orders. Peers are addressed by their rank inside a group; in the world group that is the
layout's global rank.

A generation's communicators end in one of two ways. A hard abort of its AbortSignal aborts
them all at once (`build_groups` registers that on it; it runs on whatever thread makes the abort hard): nothing is posted on
them afterwards, and on NCCL their pending operations end. A generation that is replaced is
`retire`d at the switch: aborted if its step was abandoned, and NCCL's shut down; gloo's
connections are closed later (`close`), once every worker of the next generation has left it
(after that generation's first committed step: a slower peer still reading from a closed gloo
connection would fail).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from elastic.comm import P2P, Communicator, Handle, Recorder, open_communicator
from elastic.comm.device import bind_thread
from elastic.model.tensor_parallel import TensorParallel
from elastic.parallel.abort import AbortSignal, call_abortable, fetch, wait_work
from elastic.parallel.layout import ParallelLayout
from elastic.parallel.plan_ranks import all_group_ranks

PostFn = Callable[[Sequence[P2P]], Handle]
"""Posts a group of point-to-point operations on the world communicator."""


@runtime_checkable
class Releasable(Protocol):
    """A store that keeps itself alive until released (elastic/coordinator/store.py)."""

    def release(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class ParallelGroups:
    """The communicators one worker uses in one generation."""

    world: Communicator
    """Every worker of the generation (p2p between stages, step agreement, grad norm, loss)."""
    tp: TensorParallel
    """My tensor-parallel context (group of my node's workers)."""
    buckets: dict[tuple[int, ...], Communicator | None]
    """Gradient-bucket group for each holder rank set of mine; None for a set of one."""
    abort: AbortSignal | None = None
    """The generation's abort flag every cross-worker wait of a step checks; None: plain waits."""
    store: dist.Store | None = None
    """The store the groups were built on, held as long as they live: a group keeps only the C++
    side of a Python store (pytorch#115977), so a lazily connecting group (TORCH_GLOO_LAZY_INIT=1)
    whose caller dropped a temporary store would fail its first collective ("pure virtual
    Store::wait"). `build_groups` fills it."""
    recorder: Recorder | None = None
    """The recording group's log, when the communicators record (tests, elastic/comm/record.py)."""
    created: list[Communicator] = field(default_factory=list)
    """Every communicator of the generation, in creation order."""

    @property
    def device(self) -> torch.device:
        return self.world.device

    def post(self, comm: Communicator, ops: Sequence[P2P], *, local: bool = False) -> Handle:
        """Post `ops` on `comm` as one group. A gloo group posted to a peer for the first time
        connects to it inside the call (lazy pairs), which a dead peer would block until the
        group's timeout: that one is posted abortably (`call_abortable`; with `local`, as a wait
        inside my pipeline)."""
        if comm.backend != "gloo" or all(op.peer in comm.connected for op in ops):
            return comm.post(ops)
        return call_abortable(functools.partial(comm.post, ops), self.abort, local=local)

    def p2p(self, ops: Sequence[P2P]) -> Handle:
        """`post` on the world communicator."""
        return self.post(self.world, ops)

    def p2p_local(self, ops: Sequence[P2P]) -> Handle:
        """`post` on the world communicator to peers of my pipeline (a local abort lets it go on)."""
        return self.post(self.world, ops, local=True)

    def wait(self, work: Handle) -> None:
        """Wait for operations of a step, abortably when the groups have an abort flag."""
        wait_work(work, self.abort)

    def wait_local(self, work: Handle) -> None:
        """Wait for an operation inside my pipeline (a stage-to-stage transfer): a local abort
        (a failure in another pipeline) lets it complete, a hard one ends it."""
        wait_work(work, self.abort, local=True)

    def fetch(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`'s values on the host, abortably (elastic/parallel/abort.py `fetch`)."""
        return fetch(tensor, self.abort)

    def bucket_group(self, ranks: tuple[int, ...]) -> Communicator | None:
        return self.buckets[ranks]

    def retire(self) -> None:
        """The generation is replaced: abort it if its step was abandoned, shut NCCL's
        communicators down (their memory is freed); gloo's wait for `close` (module doc)."""
        if self.abort is not None and self.abort.is_set():
            self.abort.set("the generation was replaced")  # hard: aborts every communicator (build_groups)
        for comm in self.created:
            if comm.backend != "gloo":
                comm.shutdown()

    def close(self) -> bool:
        """Close every connection of these retired groups, then release their store (a store
        that keeps itself alive for C++ holders, as EtcdStore does, has a `release`). True when
        every communicator closed: nothing is pending on them, and they may be destroyed."""
        closed = all([comm.shutdown() for comm in self.created])
        if isinstance(self.store, Releasable):
            self.store.release()
        if closed:  # the generation's abort flag holds this list (its hard-abort callback): not them
            self.created.clear()
        return closed


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
    device: torch.device | None = None,
    abort: AbortSignal | None = None,
    recorder: Recorder | None = None,
) -> ParallelGroups:
    """Build every group of `layout` that this worker belongs to, world group included, for
    tensors on `device` (default: the CPU). A hard abort of `abort` aborts them all.

    The groups keep `store` referenced (`ParallelGroups.store`), so a caller may pass a
    temporary. Store calls: each gloo group makes one `set` per member and one `wait` + `get` per
    peer it connects to (every member when gloo connects eagerly; with TORCH_GLOO_LAZY_INIT=1
    only the peers it talks to, on first use); nothing else (no `add`, no barrier).
    """
    device = device or torch.device("cpu")
    created: list[Communicator] = []
    groups_abort = abort

    def make(ranks: tuple[int, ...] | None) -> Communicator:
        members = tuple(range(layout.world_size)) if ranks is None else ranks
        comm = open_communicator(
            dist.PrefixStore(group_prefix(layout.generation, ranks), store),
            name=f"g{layout.generation}/{'world' if ranks is None else '-'.join(map(str, ranks))}",
            members=members, rank=members.index(layout.rank), backend=backend, device=device,
            timeout=timeout, recorder=recorder,
        )
        created.append(comm)
        if groups_abort is not None and groups_abort.is_hard():
            comm.abort()  # made after the abort's callbacks ran
        return comm

    def abort_created() -> None:
        bind_thread(device)  # the thread that makes the abort hard may be a control-plane feed's
        for comm in list(created):
            comm.abort()

    if groups_abort is not None:
        groups_abort.on_hard(abort_created)  # also those made so far, while the groups are being built
    world = make(None)
    made: dict[tuple[int, ...], Communicator] = {}
    for ranks in all_group_ranks(layout.plan):
        if layout.rank in ranks:
            made[ranks] = make(ranks)
    tp_ranks = layout.tp_ranks
    # Tensor-parallel peers share my node, hence my pipeline: a local abort lets them finish.
    wait = None if abort is None else functools.partial(wait_work, abort=abort, local=True)
    tp = (
        TensorParallel(group=made[tp_ranks], rank=layout.tp_rank, size=layout.tp_size, wait=wait)
        if len(tp_ranks) > 1
        else TensorParallel.single()
    )
    buckets = {b.ranks: made.get(b.ranks) for b in layout.buckets}
    return ParallelGroups(world=world, tp=tp, buckets=buckets, abort=abort, store=store, recorder=recorder,
                          created=created)
