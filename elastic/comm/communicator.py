"""A communicator: one real `torch.distributed.ProcessGroup` of one generation, posted to the way
NCCL needs it.

NCCL's rules, which every caller of this module follows (and `nccl_model.check` proves on the
recorded logs of CPU runs):

- A communicator runs its operations in posting order, on one stream per rank: an operation
  waits for every operation posted before it on the same communicator.
- An ungrouped send or receive completes only when the peer reaches the matching operation
  (large messages are not buffered), and an ungrouped point-to-point operation runs on a
  two-rank communicator that torch creates lazily, inside the first call, as a blocking
  rendezvous with the peer. So point-to-point operations are posted in groups (`post`): one
  NCCL group (`ncclGroupStart/End`, torch's coalescing) on the communicator itself, whose
  operations all progress together, in any order within the group.
- Every member posts the communicator's collectives in the same order. Tags are ignored:
  the n-th send from A to B matches B's n-th receive from A.
- Creating a communicator is a blocking rendezvous of all its members: `open_communicator`
  creates it at once (NCCL: bound to the device, connected eagerly), in one order every member
  follows.
- `work.wait()` does not block the host on NCCL (it makes the current stream wait), so a step
  cannot be abandoned by leaving a wait: an abort must abort the communicators (`abort`), which
  this module makes safe by creating NCCL communicators non-blocking.

With gloo (CPU) the same calls run each operation on its own (gloo has no groups), and gloo's
`abort` changes nothing (torch 2.13): an aborted gloo communicator only refuses new posts, and
its pending operations end when `shutdown` closes its connections (`_close_gloo`).

A communicator with a `Recorder` logs every creation, post, wait, abort and shutdown
(elastic/comm/record.py).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from elastic.comm.record import Op, Recorder

log = logging.getLogger(__name__)

NCCL_ENV: dict[str, str] = {
    # Communicators are created non-blocking, so that `abort` (ncclCommAbort) never hangs on a
    # communicator whose operations wait for a dead peer.
    "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
    # On a collective's timeout the watchdog aborts the communicators and does not kill the
    # process (the default tears the process down: one lost peer would end every survivor).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # The heartbeat monitor kills a process whose watchdog seems stuck (an abort in progress).
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    # No flight-recorder dump to disk when an abandoned operation times out.
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    # `wait()` stays a stream wait: a host wait is done abortably by the caller.
    "TORCH_NCCL_BLOCKING_WAIT": "0",
}
"""The NCCL watchdog and communicator settings of a worker: explicit, so that no survivor is
killed by the watchdog when a peer fails (values set in the environment win)."""


def apply_nccl_env() -> None:
    """Set NCCL_ENV in this process's environment (a value already set is kept). torch reads
    these when a NCCL process group is constructed: call before the first one."""
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)


class CommAborted(RuntimeError):
    """A post on a communicator that was aborted (its generation was given up)."""


@dataclass(frozen=True)
class P2P:
    """One point-to-point operation of a group."""

    kind: str
    """"send" or "recv"."""
    tensor: torch.Tensor
    """What is sent, or where it is received (contiguous)."""
    peer: int
    """The peer's rank in the communicator."""
    tag: int = 0
    """gloo matches by (peer, tag); NCCL ignores it."""

    def __post_init__(self) -> None:
        if self.kind not in ("send", "recv"):
            raise ValueError(f"a point-to-point operation is 'send' or 'recv', got {self.kind!r}")


class Handle:
    """Operations posted together: complete when all of them are."""

    __slots__ = ("_works", "_recorder", "ids", "host_blocking")

    def __init__(
        self, works: Sequence[dist.Work], recorder: Recorder | None, ids: tuple[int, ...], *, host_blocking: bool = True
    ) -> None:
        self._works = tuple(works)
        self._recorder = recorder
        self.ids = ids
        """The recorded operations' ids (empty without a recorder)."""
        self.host_blocking = host_blocking
        """Whether `wait` blocks the host until the operations are done (gloo); False on NCCL,
        whose `wait` only makes the current stream wait."""

    def wait(self) -> None:
        """Wait for every operation (NCCL: the current stream waits; the host does not) and log it."""
        self.complete()
        self.note_waited()

    def complete(self) -> None:
        """`wait` without logging it (an abortable waiter logs for its caller: `note_waited`)."""
        for work in self._works:
            work.wait()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def note_waited(self, *, abandoned: bool = False) -> None:
        """Log a wait on these operations in the calling lane; `abandoned`: the caller gave up
        on them (its generation was aborted) and goes on without them."""
        if self._recorder is not None:
            self._recorder.wait(self.ids, abandoned=abandoned)


class Communicator:
    """One process group of one generation, with the calls that respect NCCL's rules (module doc)."""

    def __init__(
        self, group: dist.ProcessGroup, *, name: str, members: Sequence[int], backend: str,
        device: torch.device, recorder: Recorder | None = None, native: Any = None,
    ) -> None:
        """Use `group` (a `dist.ProcessGroup`, or a backend object torch accepts as one) as the
        communicator `name`; `members`: each member's world rank, by rank in the group.
        `native`: the backend object behind `group` (gloo's close needs it)."""
        self.group = group
        self.name = name
        self.members = tuple(members)
        self.rank = group.rank()
        self.size = group.size()
        self.backend = backend
        self.device = device
        self.recorder = recorder
        self._native = native if native is not None else group
        self._lock = threading.Lock()
        self._aborted = False
        self._closed = False
        self.connected: set[int] = set()
        """Peers a point-to-point operation was posted to (gloo connects lazily: the first post
        to a peer may block while it connects)."""
        if len(self.members) != self.size:
            raise ValueError(f"communicator {name}: {len(self.members)} members named for a group of {self.size}")
        if recorder is not None:
            recorder.create(name, self.members, self.rank)

    @property
    def aborted(self) -> bool:
        return self._aborted

    @property
    def closed(self) -> bool:
        """Aborted or shut down: its connections are gone, or going."""
        return self._closed or self._aborted

    # ---- posting -------------------------------------------------------------------------

    def post(self, ops: Sequence[P2P]) -> Handle:
        """Post `ops` as one group (NCCL: one coalesced NCCL group on this communicator; gloo:
        each on its own). Sends and receives of a group progress together, so two ranks may
        send to each other in one group."""
        if not ops:
            return Handle((), None, ())
        self._check_open()
        for op in ops:
            if not 0 <= op.peer < self.size or op.peer == self.rank:
                raise ValueError(f"communicator {self.name}: peer {op.peer} is not another rank of {self.size}")
        recorded = self._record(ops, grouped=True)
        coalesce = self.backend == "nccl"
        if coalesce:
            self.group._start_coalescing(self.device)  # torch's batch_isend_irecv does the same
        works = [self._p2p(op) for op in ops]
        if coalesce:
            works = [self.group._end_coalescing(self.device)]
        self.connected.update(op.peer for op in ops)
        return Handle(works, self.recorder, recorded, host_blocking=self.backend != "nccl")

    def post_ungrouped(self, op: P2P) -> Handle:
        """One point-to-point operation outside any group. On NCCL it runs on a two-rank
        communicator created lazily, inside this call, as a blocking rendezvous with the peer,
        and it completes only when the peer reaches the matching operation: deadlock-prone
        (module doc). Kept for the tests that show why `post` exists."""
        self._check_open()
        recorded = self._record([op], grouped=False)
        work = self._p2p(op)
        self.connected.add(op.peer)
        return Handle([work], self.recorder, recorded, host_blocking=self.backend != "nccl")

    def all_reduce(self, tensor: torch.Tensor, *, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Handle:
        """Post an all-reduce of `tensor` in place."""
        self._check_open()
        recorded = self._record_collective("all_reduce", tensor.numel() * tensor.element_size())
        work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        assert work is not None
        return Handle([work], self.recorder, recorded, host_blocking=self.backend != "nccl")

    def all_gather(self, parts: list[torch.Tensor], tensor: torch.Tensor) -> Handle:
        """Post an all-gather of every rank's `tensor` into `parts` (one per rank)."""
        self._check_open()
        recorded = self._record_collective("all_gather", tensor.numel() * tensor.element_size())
        work = dist.all_gather(parts, tensor, group=self.group, async_op=True)
        assert work is not None
        return Handle([work], self.recorder, recorded, host_blocking=self.backend != "nccl")

    # ---- the end -------------------------------------------------------------------------

    def abort(self) -> None:
        """Give the communicator up: no post is accepted from now on; NCCL aborts its
        communicators (non-blocking: never hangs), which ends their pending operations with an
        error and frees their memory. gloo has no abort that works (module doc): its pending
        operations end when `shutdown` closes it. Idempotent; safe from any thread."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
        if self.recorder is not None:
            self.recorder.add("abort", comm=self.name)
        if self.backend == "nccl":
            self.group.abort()

    def shutdown(self) -> bool:
        """Release the communicator's connections once nobody uses it any more: NCCL shuts it
        down (or it was aborted already); gloo closes its connections (`_close_gloo`), which
        also fails any operation still pending on it. True when closed. Idempotent."""
        with self._lock:
            if self._closed:
                return True
            self._closed = True
        if self.recorder is not None:
            self.recorder.add("shutdown", comm=self.name)
        if self.backend == "nccl":
            if not self._aborted:
                self.group.shutdown()
            return True
        return _close_gloo(self._native)

    # ---- helpers -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._aborted or self._closed:
            raise CommAborted(f"communicator {self.name} was {'aborted' if self._aborted else 'shut down'}")

    def _p2p(self, op: P2P) -> dist.Work:
        if op.kind == "send":
            work = self.group.send([op.tensor], op.peer, op.tag)
        else:
            work = self.group.recv([op.tensor], op.peer, op.tag)
        return cast(dist.Work, work)

    def _record(self, ops: Sequence[P2P], *, grouped: bool) -> tuple[int, ...]:
        if self.recorder is None:
            return ()
        rec = self.recorder
        logged = [Op(id=rec.next_id(), kind=o.kind, peer=o.peer, nbytes=o.tensor.numel() * o.tensor.element_size(),
                     tag=o.tag) for o in ops]
        rec.post(self.name, logged, grouped=grouped)
        return tuple(o.id for o in logged)

    def _record_collective(self, kind: str, nbytes: int) -> tuple[int, ...]:
        if self.recorder is None:
            return ()
        op = Op(id=self.recorder.next_id(), kind=kind, nbytes=nbytes)
        self.recorder.post(self.name, [op], grouped=False)
        return (op.id,)


def open_communicator(
    store: dist.Store, *, name: str, members: Sequence[int], rank: int, backend: str, device: torch.device,
    timeout: timedelta, recorder: Recorder | None = None,
) -> Communicator:
    """Create communicator `name` of `members` (world ranks, by group rank) as group rank `rank`,
    on `store` (a prefix of its own): a rendezvous of every member (blocks until all joined).

    The result is a real `dist.ProcessGroup` with the backend registered for `device`, as
    `torch.distributed.new_group` makes one, but without the default group (which a live process
    cannot re-create for a later generation). NCCL: non-blocking (NCCL_ENV), bound to `device`
    and connected at once, so no operation creates a communicator lazily. gloo connects each
    pair at creation, or on first use with TORCH_GLOO_LAZY_INIT=1.
    """
    size = len(members)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside communicator {name} of {size} members")
    group = dist.ProcessGroup(store, rank, size)
    native: Any
    if backend == "gloo":
        native = dist.ProcessGroupGloo(store, rank, size, timeout)
        kind = dist.ProcessGroup.BackendType.GLOO
    elif backend == "nccl":
        apply_nccl_env()
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout  # the constructor takes the timeout only through Options
        config = getattr(options, "config", None)
        if config is not None and hasattr(config, "blocking"):
            config.blocking = 0  # non-blocking: ncclCommAbort never hangs (also TORCH_NCCL_USE_COMM_NONBLOCKING)
        native = dist.ProcessGroupNCCL(store, rank, size, options)
        kind = dist.ProcessGroup.BackendType.NCCL
    else:
        raise ValueError(f"unsupported backend {backend!r} (gloo or nccl)")
    # Private API: the public way (`new_group`) needs the default group, which this project
    # never creates (module doc); this is what torch's own `_new_process_group_helper` does.
    group._set_default_backend(kind)
    group._register_backend(device, kind, native)
    comm = Communicator(group, name=name, members=members, backend=backend, device=device, recorder=recorder,
                        native=native)
    if backend == "nccl":
        group.bound_device_id = device
        native.eager_connect_single_device(device)  # the rendezvous happens here, not in a first operation
    return comm


# ---- gloo's close --------------------------------------------------------------------------

CLOSE_TAG = 0x7FFF_FF00
"""Tag of the receive that closes a gloo group: no step, transfer or test posts it."""
_CLOSE_WAIT = timedelta(milliseconds=1)


def _close_gloo(group: Any) -> bool:
    """Close every connection of the gloo group `group`; True when closed (or nothing to close).

    gloo has no call that closes a group (`abort` and `shutdown` of a gloo group change nothing
    in torch 2.13: a pending all-reduce still waited out its timeout), and left open a retired
    group costs CPU for the rest of the run: gloo's TCP loop polls its sockets level-triggered,
    and a pair whose queued write or expected read belongs to an abandoned operation (its tensors
    freed) never progresses, so each wake-up finds the same socket ready and returns at once
    (measured in the effective-time benchmark, small model, one spare: one such loop thread per
    survivor used ~0.7 s of CPU per second, and each loss added more). Its one way is a wait that
    times out: gloo then tells every pair of the group's context of the error, which closes each
    connection and takes it off the loop, and fails every operation still pending on the group.
    So this posts a receive nobody will send, on a tag nothing else uses, and waits 1 ms for it.
    Never blocks: a pair whose peer died is closed already, and the receive goes to the next peer.
    """
    if group.size() < 2:
        return True
    me = group.rank()
    for peer in (r for r in range(group.size()) if r != me):
        try:
            work = group.recv([torch.empty(1)], peer, CLOSE_TAG)
            work.wait(_CLOSE_WAIT)
        except RuntimeError as exc:
            if "Timed out" in str(exc):
                return True  # the timeout closed every pair of the group's context
            continue  # this pair was closed already (its peer died): another one carries it
        log.warning("a retired group answered the closing receive: a peer sent on tag %d", CLOSE_TAG)
        return False
    return True  # every pair was closed already
