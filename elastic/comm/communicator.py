"""A communicator: one real `torch.distributed.ProcessGroup` of one generation, posted to the way
NCCL needs it (`elastic/comm/opening.py` makes one).

NCCL's rules, which every caller of this module follows (and `nccl_model.check` proves on the
recorded logs of CPU runs):

- A communicator runs its operations in posting order, on one stream per rank: an operation
  waits for every operation posted before it on the same communicator.
- An ungrouped send or receive completes only when the peer reaches the matching operation
  (large messages are not buffered). On a communicator connected eagerly (the default, blocking
  mode: `opening.py`) it runs on the group's own NCCL communicator, in the group's one queue;
  on one created lazily (non-blocking mode) torch makes a two-rank communicator for the pair
  inside the first call, as a blocking rendezvous with the peer. Either way it is
  deadlock-prone, so point-to-point operations are posted in groups (`post`): one NCCL group
  (`ncclGroupStart/End`, torch's coalescing) on the communicator itself, whose operations all
  progress together, in any order within the group.
- Every member posts the communicator's collectives in the same order. Tags are ignored:
  the n-th send from A to B matches B's n-th receive from A.
- One thread posts to a communicator: torch keeps a group's coalescing state per group, NCCL
  its group depth per thread, so two threads posting one communicator could nest one's
  operations into the other's group.
- Creating a communicator is a blocking rendezvous of all its members, in one order every
  member follows.
- `work.wait()` does not block the host on NCCL (it makes the current stream wait), so a step
  cannot be abandoned by leaving a wait: an abort must abort the communicators (`abort`). The
  backend's abort runs on a thread of its own (it may block, and raise, on a communicator whose
  kernels wait for a dead peer): the thread that makes the abort goes on at once, and an error
  is logged, never raised. A communicator is never shut down with work pending (a shutdown
  would wait for it): `shutdown` aborts such a one instead.

With gloo (CPU) the same calls run each operation on its own (gloo has no groups), and gloo's
`abort` changes nothing (torch 2.13): an aborted gloo communicator only refuses new posts, and
its pending operations end when `shutdown` closes its connections (`_close_gloo`).

A communicator with a `Recorder` logs every creation, post, wait, abort and shutdown
(elastic/comm/record.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from elastic.comm.device import bind_thread
from elastic.comm.record import Op, Recorder

log = logging.getLogger(__name__)

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

    __slots__ = ("_works", "_recorder", "ids", "host_blocking", "done")

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
        self.done = not self._works
        """Whether a wait on the operations returned (they are no longer pending)."""

    def wait(self) -> None:
        """Wait for every operation (NCCL: the current stream waits; the host does not) and log it."""
        self.complete()
        self.note_waited()

    def complete(self) -> None:
        """`wait` without logging it (an abortable waiter logs for its caller: `note_waited`)."""
        for work in self._works:
            work.wait()
        self.done = True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def pending(self) -> bool:
        """Whether the operations may still be queued: never waited for, and not complete."""
        return not self.done and not self.is_completed()

    def note_waited(self, *, abandoned: bool = False) -> None:
        """Log a wait on these operations in the calling lane; `abandoned`: the caller gave up
        on them (its generation was aborted) and goes on without them."""
        if self._recorder is not None:
            self._recorder.wait(self.ids, abandoned=abandoned)


_PRUNE_AT = 64
"""A communicator forgets the handles it posted that are done once it keeps this many."""


class Communicator:
    """One process group of one generation, with the calls that respect NCCL's rules (module doc)."""

    def __init__(
        self, group: dist.ProcessGroup, *, name: str, members: Sequence[int], backend: str,
        device: torch.device, recorder: Recorder | None = None, native: Any = None, eager: bool = True,
        abort_join_s: float = 60.0,
    ) -> None:
        """Use `group` (a `dist.ProcessGroup`, or a backend object torch accepts as one) as the
        communicator `name`; `members`: each member's world rank, by rank in the group.
        `native`: the backend object behind `group` (gloo's close needs it). `eager`: NCCL
        connects it at creation (ungrouped point-to-point operations then run on its own queue),
        as the recording says; `abort_join_s`: how long `shutdown` waits for a backend abort."""
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
        self._posted: list[Handle] = []
        self._abort_thread: threading.Thread | None = None
        self._abort_join_s = abort_join_s
        self.abort_error: BaseException | None = None
        """What the backend's abort raised (logged; the communicator counts as aborted)."""
        self.connected: set[int] = set()
        """Peers a point-to-point operation was posted to (gloo connects lazily: the first post
        to a peer may block while it connects)."""
        if len(self.members) != self.size:
            raise ValueError(f"communicator {name}: {len(self.members)} members named for a group of {self.size}")
        if recorder is not None:
            recorder.create(name, self.members, self.rank, eager=eager)

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
        return self._posted_handle(works, recorded)

    def post_ungrouped(self, op: P2P) -> Handle:
        """One point-to-point operation outside any group. On NCCL it completes only when the
        peer reaches the matching operation, behind everything posted before it on this
        communicator (connected eagerly) or after a rendezvous with the peer that creates their
        pair's communicator inside this call (connected lazily): deadlock-prone (module doc).
        Kept for the tests that show why `post` exists."""
        self._check_open()
        recorded = self._record([op], grouped=False)
        work = self._p2p(op)
        self.connected.add(op.peer)
        return self._posted_handle([work], recorded)

    def all_reduce(self, tensor: torch.Tensor, *, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Handle:
        """Post an all-reduce of `tensor` in place."""
        self._check_open()
        recorded = self._record_collective("all_reduce", tensor.numel() * tensor.element_size())
        work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        assert work is not None
        return self._posted_handle([work], recorded)

    def all_gather(self, parts: list[torch.Tensor], tensor: torch.Tensor) -> Handle:
        """Post an all-gather of every rank's `tensor` into `parts` (one per rank)."""
        self._check_open()
        recorded = self._record_collective("all_gather", tensor.numel() * tensor.element_size())
        work = dist.all_gather(parts, tensor, group=self.group, async_op=True)
        assert work is not None
        return self._posted_handle([work], recorded)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor) -> Handle:
        """Post a reduce-scatter (sum) of every rank's `tensor` into `output`: rank r gets the sum
        of chunk r of the first dimension (`output` is 1/size of `tensor`)."""
        self._check_open()
        recorded = self._record_collective("reduce_scatter", tensor.numel() * tensor.element_size())
        # torch 2.13 names it reduce_scatter_single (reduce_scatter_tensor, deprecated, before)
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        work = reduce_scatter(output, tensor, group=self.group, async_op=True)
        assert work is not None
        return self._posted_handle([work], recorded)

    def pending(self) -> int:
        """How many posted groups of operations may still be queued (never waited for, not complete)."""
        with self._lock:
            return self._count_pending()

    # ---- the end -------------------------------------------------------------------------

    def abort(self) -> None:
        """Give the communicator up: no post is accepted from now on. NCCL aborts its
        communicators (`ncclCommAbort`: their pending operations end with an error, their memory
        is freed) on a thread of its own, so the caller never blocks on it; what it raises is
        logged and kept in `abort_error`. gloo has no abort that works (module doc): its pending
        operations end when `shutdown` closes it. Idempotent; safe from any thread."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
        if self.recorder is not None:
            self.recorder.add("abort", comm=self.name)
        if self.backend == "nccl":
            self._abort_thread = threading.Thread(target=self._abort_backend, name=f"abort {self.name}", daemon=True)
            self._abort_thread.start()

    def shutdown(self) -> bool:
        """Release the communicator's connections once nobody uses it any more: NCCL shuts it
        down, or waits (up to `abort_join_s`) for its abort; gloo closes its connections
        (`_close_gloo`), which also fails any operation still pending on it. A communicator
        with work still pending is aborted first: NCCL's shutdown would wait for that work,
        which a dead peer or an abandoned step never completes. True when closed. Idempotent."""
        with self._lock:
            if self._closed:
                return True
            pending = 0 if self._aborted else self._count_pending()
        if pending:
            log.warning("communicator %s: shut down with %d group(s) of operations pending: aborted instead",
                        self.name, pending)
            self.abort()
        with self._lock:
            if self._closed:
                return True
            self._closed = True
            self._posted.clear()
        if self.recorder is not None:
            self.recorder.add("shutdown", comm=self.name)
        if self.backend == "nccl":
            return self._end_nccl()
        return _close_gloo(self._native)

    # ---- helpers -------------------------------------------------------------------------

    def _end_nccl(self) -> bool:
        if not self._aborted:
            self.group.shutdown()
            return True
        thread = self._abort_thread
        if thread is not None:
            thread.join(self._abort_join_s)
            if thread.is_alive():
                log.warning("communicator %s: its abort has not returned after %.0f s", self.name, self._abort_join_s)
                return False
        return True

    def _abort_backend(self) -> None:
        bind_thread(self.device)
        try:
            self.group.abort()
        except Exception as exc:  # the generation is given up all the same: nothing waits on it
            self.abort_error = exc
            log.warning("communicator %s: the backend's abort raised %s: %s", self.name, type(exc).__name__, exc)

    def _count_pending(self) -> int:
        """`pending`, with the lock held by the caller."""
        return sum(h.pending() for h in self._posted)

    def _posted_handle(self, works: Sequence[dist.Work], recorded: tuple[int, ...]) -> Handle:
        handle = Handle(works, self.recorder, recorded, host_blocking=self.backend != "nccl")
        with self._lock:
            if len(self._posted) >= _PRUNE_AT:
                self._posted = [h for h in self._posted if h.pending()]
            self._posted.append(handle)
        return handle

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
