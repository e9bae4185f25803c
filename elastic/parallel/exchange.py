"""The tree-order bucket exchange of a worker's steps, run on a thread of its own.

A bucket's block sums (elastic/parallel/blocks.py) are reduced with the step's one summation
tree in two phases of point-to-point transfers on its bucket group: every holder sends slice j
of each of its blocks' sums to holder j and receives its own slice of every other holder's
blocks; then it combines its slice of all the holders' blocks in tree order and sends the
result to every other holder, receiving theirs likewise (an all-gather). With one block per
holder that is the bytes of a float32 reduce-scatter and all-gather: DDP's all-reduce. While
the slice is in cache the holder also measures it (the sum of squares of the result): each
holder measures its own slice of every bucket, so the gradient norm costs each of them 1/P of
a pass, off the training thread.

Run on the training thread, every part of this stalls the backward it should overlap: gloo
writes a posted send inline (megabytes of copying), the second phase waits for the peers'
first, and the combine is a pass over the slice. So the training thread only hands each bucket
over as its sums are final (`submit`, never blocks), and the exchange's thread posts, waits,
combines and posts again, in the order it was handed the buckets (every holder hands them over
in one global order, so no two holders wait for each other in opposite orders). DDP's
all-reduce likewise runs on gloo's own thread. The thread is kept from step to step and ends
when it has been idle for a while (IDLE_EXIT_S).

`finish` waits for the thread abortably (StepAborted as soon as the generation's abort flag it
is given is set, like `groups.wait`) and re-raises its error on the training thread. An
abandoned exchange (an abort, a failed transfer, or the step failed elsewhere) never writes to
its buffers again: the thread checks that under a lock before every pass over them, and the
training thread takes the lock to abandon it. A thread left blocked on a dead peer's transfer
ends when that transfer fails.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastic.parallel.abort import AbortSignal, StepAborted, wait_event
from elastic.parallel.blocks import Block, CombineProgram, combine


@dataclass(frozen=True, kw_only=True)
class TreeBucket:
    """One bucket's exchange: what the thread reads, writes and talks to."""

    sums: tuple[torch.Tensor, ...]
    """My sums of the bucket, one flat buffer per block of mine (`blocks[me]`), each padded to
    a multiple of the holder count (only read)."""
    result: torch.Tensor
    """The reduced buffer, as long as each of `sums` (written: every slice)."""
    blocks: tuple[tuple[Block, ...], ...]
    """Per holder, the blocks it sends (every holder computes the same lists)."""
    received: tuple[tuple[torch.Tensor, ...] | None, ...]
    """Per holder, one buffer of one slice per block of its, for its sums of my slice (None at mine)."""
    scratch: tuple[torch.Tensor, ...]
    """Work buffers of the combine, each one chunk long (`blocks.combine`)."""
    wide: torch.Tensor | None = None
    """A float64 chunk buffer for measuring (needed with `norm`)."""
    norm: torch.Tensor | None = None
    """A 0-dim float64 tensor the thread writes the sum of squares of my slice of the result into
    (None: not wanted). The holders' slices cover the bucket once, so their values add up to
    the bucket's share of the global gradient norm."""
    program: CombineProgram | None = None
    """The combine of all the holders' blocks, when the caller keeps one (else made here)."""
    group: dist.ProcessGroup
    """The bucket group; holders are addressed by their rank in it."""
    me: int
    """My rank in the bucket group."""
    tag: int
    """Tag of the first phase; the second uses tag + 1."""

    @property
    def holders(self) -> int:
        return len(self.blocks)


class _Round:
    """The end of one step's buckets: set once they are all complete on this worker."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


SUM_CHUNK = 1 << 16
"""Elements combined and measured at a time (the scratch buffers' length). A slice-long work
buffer costs a write and a re-read of the whole slice from memory; in chunks of this size
the sum and the sum of squares take one pass over it (8 Ki to 128 Ki measured on this
project's CPU machine for the float64 sums of before: 64 Ki the fastest)."""

IDLE_EXIT_S = 5.0
"""How long the exchange thread waits for work before it ends (the next `submit` starts a new
one): a generation's thread does not outlive its steps by more than that."""


class TreeExchange:
    """The tree-order exchanges of one worker, step after step, on one thread (module doc).

    Each step `submit`s its buckets and then `finish`es them. The thread is kept from step to
    step (starting a thread, and ending one, each cost the step a few hundred microseconds) and
    ends after IDLE_EXIT_S without work. Once abandoned (`abandon`, an abort, or a failed
    transfer) an exchange takes no more work: the owner makes a new one (`abandoned`).
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[TreeBucket | _Round] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._abandoned = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._submitted = False

    @property
    def abandoned(self) -> bool:
        """Whether this exchange was given up (no more work: make a new one)."""
        return self._abandoned

    def submit(self, bucket: TreeBucket) -> None:
        """Exchange `bucket` after the ones submitted before it; never blocks."""
        if self._abandoned:
            if self._error is not None:
                raise self._error  # a transfer failed: say what, not just that
            raise RuntimeError("this exchange was abandoned; make a new one")
        self._put(bucket)
        self._submitted = True

    def finish(self, abort: AbortSignal | None) -> None:
        """Wait until every bucket submitted since the last `finish` is complete on this worker.
        StepAborted when `abort` (the generation's flag) is set first, the thread's error when a
        transfer failed; either way the exchange is abandoned."""
        if not self._submitted:
            return
        self._submitted = False
        end = _Round()
        self._put(end)
        try:
            wait_event(end.done, abort)
        except StepAborted:
            self.abandon()
            raise
        if self._error is not None:
            raise self._error

    def abandon(self) -> None:
        """Stop: the thread touches no buffer from now on and ends as soon as it can."""
        with self._lock:
            self._abandoned = True

    def _put(self, item: TreeBucket | _Round) -> None:
        with self._lock:  # the thread ends only under the lock, with nothing queued
            self._jobs.put(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tree-exchange", daemon=True)
                self._thread.start()

    def _next(self, *, block: bool) -> TreeBucket | _Round | None:
        """The next item handed over; None when there is none (not `block`), or when the thread
        waited IDLE_EXIT_S for one and ends (`self._thread` cleared under the lock)."""
        while True:
            try:
                return self._jobs.get(block=block, timeout=IDLE_EXIT_S if block else None)
            except queue.Empty:
                if not block:
                    return None
                with self._lock:
                    if self._jobs.empty():
                        self._thread = None
                        return None

    def _run(self) -> None:
        first: list[tuple[TreeBucket, list[dist.Work]]] = []
        second: list[dist.Work] = []
        while True:
            item = self._next(block=not first)
            try:
                if isinstance(item, _Round):
                    while first and not self._abandoned:
                        self._complete_first(*first.pop(0), second)
                    if not self._abandoned:
                        for work in second:
                            work.wait()
                elif item is not None:
                    if not self._abandoned:
                        first.append((item, self._post_first(item)))
                elif first:
                    self._complete_first(*first.pop(0), second)
                else:
                    return  # idle: ended
            except BaseException as exc:  # handed to `finish`; the exchange is done for
                with self._lock:
                    if self._error is None:
                        self._error = exc
                    self._abandoned = True
            if isinstance(item, _Round) or self._abandoned:
                first.clear()
                second.clear()
            if isinstance(item, _Round):
                item.done.set()
            if self._abandoned:
                with self._lock:  # it takes no more work: end now, not after IDLE_EXIT_S
                    if self._jobs.empty():
                        self._thread = None
                        return

    def _complete_first(self, job: TreeBucket, works: list[dist.Work], second: list[dist.Work]) -> None:
        """Wait for `job`'s first phase, sum and round my slice, post the second phase."""
        for work in works:
            work.wait()
        with self._lock:
            if self._abandoned:
                return
            self._sum(job)
        second.extend(self._post_second(job))

    @staticmethod
    def _post_first(job: TreeBucket) -> list[dist.Work]:
        """Each other holder's slice of each of my blocks to it; its blocks of my slice into
        `received` (one message per block, in block order, on one tag: a FIFO channel)."""
        slices = [flat.chunk(job.holders) for flat in job.sums]
        works: list[dist.Work] = []
        for j in range(job.holders):
            if j != job.me:
                into = job.received[j]
                assert into is not None and len(into) == len(job.blocks[j])
                works.extend(_p2p("recv", buf, job, j, job.tag) for buf in into)
                works.extend(_p2p("send", parts[j], job, j, job.tag) for parts in slices)
        return works

    @staticmethod
    def _sum(job: TreeBucket) -> None:
        """My slice of every holder's blocks combined in tree order into the result, and the
        result's sum of squares into `job.norm`, chunk by chunk (`blocks.combine`)."""
        blocks: list[Block] = []
        parts: list[torch.Tensor] = []
        for j, theirs in enumerate(job.blocks):
            received = job.received[j]
            bufs = [flat.chunk(job.holders)[job.me] for flat in job.sums] if received is None else list(received)
            blocks.extend(theirs)
            parts.extend(bufs)
        result = job.result.chunk(job.holders)[job.me]
        combine(blocks, parts, result, job.scratch, program=job.program, norm=job.norm, wide=job.wide)

    @staticmethod
    def _post_second(job: TreeBucket) -> list[dist.Work]:
        """My slice of the result to each other holder; theirs into their slices of it."""
        results = job.result.chunk(job.holders)
        works = []
        for j in range(job.holders):
            if j != job.me:
                works.append(_p2p("recv", results[j], job, j, job.tag + 1))
                works.append(_p2p("send", results[job.me], job, j, job.tag + 1))
        return works


def _p2p(op: str, tensor: torch.Tensor, job: TreeBucket, peer: int, tag: int) -> dist.Work:
    """Post a send or receive of `tensor` with holder `peer` (the first one with a peer connects
    to it first, inside the call: this thread may block there, the training thread does not)."""
    if op == "send":
        work = dist.isend(tensor, group=job.group, group_dst=peer, tag=tag)
    else:
        work = dist.irecv(tensor, group=job.group, group_src=peer, tag=tag)
    assert work is not None
    return work
