"""The exact float64 bucket exchange of a worker's steps, run on a thread of its own.

A bucket's float64 sums are reduced exactly with float32 results in two phases of
point-to-point transfers on its bucket group (grad_sync.py's module doc): every holder sends
slice j of its sums to holder j and receives its own slice from every other one; then it sums
its slice in holder order, rounds it to float32 once and sends that to every other holder,
receiving theirs likewise. While the slice is in cache it also measures it (the sum of squares
of the rounded values): each holder measures its own slice of every bucket, so the gradient
norm costs each of them 1/P of a pass, off the training thread, instead of a whole pass on one
holder while the others wait in the vote.

Run on the training thread, every part of this stalls the backward it should overlap: gloo
writes a posted send inline (megabytes of copying), the second phase waits for the peers'
first, and the sum and the rounding are passes over the bucket. So the training thread only
hands each bucket over as its sums are final (`submit`, never blocks), and the exchange's thread
posts, waits, sums, rounds and posts again, in the order it was handed the buckets (every
holder hands them over in one global order, so no two holders wait for each other in opposite
orders). DDP's all-reduce likewise runs on gloo's own thread. The thread is kept from step to
step and ends when it has been idle for a while (IDLE_EXIT_S).

`finish` waits for the thread abortably (StepAborted as soon as the generation's abort flag it
is given is set, like `groups.wait`) and re-raises its error on the training thread. An abandoned exchange
(an abort, a failed transfer, or the step failed elsewhere) never writes to its buffers again: the thread checks
that under a lock before every pass over them, and the training thread takes the lock to
abandon it. A thread left blocked on a dead peer's transfer ends when that transfer fails.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastic.parallel.abort import AbortSignal, StepAborted, wait_event


@dataclass(frozen=True, kw_only=True)
class ExactBucket:
    """One bucket's exchange: what the thread reads, writes and talks to."""

    flat: torch.Tensor
    """The bucket's float64 sums, padded to a multiple of the holder count (only read)."""
    result: torch.Tensor
    """Its float32 reduced buffer, as long as `flat` (written: every slice)."""
    received: tuple[torch.Tensor | None, ...]
    """Per holder, a float64 buffer of one slice for that holder's sums of mine (None at mine)."""
    scratch: torch.Tensor
    """A float64 work buffer for the sum, SUM_CHUNK elements (or one slice, if shorter)."""
    norm: torch.Tensor | None = None
    """A 0-dim float64 tensor the thread writes the sum of squares of my rounded slice into
    (None: not wanted). The holders' slices cover the bucket once, so their values add up to
    the bucket's share of the global gradient norm."""
    group: dist.ProcessGroup
    """The bucket group; holders are addressed by their rank in it."""
    me: int
    """My rank in the bucket group."""
    tag: int
    """Tag of the first phase; the second uses tag + 1."""


class _Round:
    """The end of one step's buckets: set once they are all complete on this worker."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


SUM_CHUNK = 1 << 16
"""Elements summed, rounded and measured at a time (512 KiB of float64 scratch). A slice-long
sum buffer costs a write and a re-read of the whole slice from memory; tiny's 0.43 M-element
slices took 0.56 ms to sum and round that way and 0.89 ms with the sum of squares, 0.58 ms
for all three in chunks of this size (one thread, this project's CPU machine; 8 Ki to 128 Ki
measured, 64 Ki the fastest)."""

IDLE_EXIT_S = 5.0
"""How long the exchange thread waits for work before it ends (the next `submit` starts a new
one): a generation's thread does not outlive its steps by more than that."""


class ExactExchange:
    """The exact exchanges of one worker, step after step, on one thread (module doc).

    Each step `submit`s its buckets and then `finish`es them. The thread is kept from step to
    step (starting a thread, and ending one, each cost the step a few hundred microseconds) and
    ends after IDLE_EXIT_S without work. Once abandoned (`abandon`, an abort, or a failed
    transfer) an exchange takes no more work: the owner makes a new one (`abandoned`).
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[ExactBucket | _Round] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._abandoned = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._submitted = False

    @property
    def abandoned(self) -> bool:
        """Whether this exchange was given up (no more work: make a new one)."""
        return self._abandoned

    def submit(self, bucket: ExactBucket) -> None:
        """Exchange `bucket` after the ones submitted before it; never blocks."""
        if self._abandoned:
            if self._error is not None:
                raise self._error  # a transfer failed: say what, not just that
            raise RuntimeError("this exact exchange was abandoned; make a new one")
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

    def _put(self, item: ExactBucket | _Round) -> None:
        with self._lock:  # the thread ends only under the lock, with nothing queued
            self._jobs.put(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="exact-exchange", daemon=True)
                self._thread.start()

    def _next(self, *, block: bool) -> ExactBucket | _Round | None:
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
        first: list[tuple[ExactBucket, list[dist.Work]]] = []
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

    def _complete_first(self, job: ExactBucket, works: list[dist.Work], second: list[dist.Work]) -> None:
        """Wait for `job`'s first phase, sum and round my slice, post the second phase."""
        for work in works:
            work.wait()
        with self._lock:
            if self._abandoned:
                return
            self._sum(job)
        second.extend(self._post_second(job))

    @staticmethod
    def _post_first(job: ExactBucket) -> list[dist.Work]:
        """Each other holder's slice of my sums to it; its sums of my slice into `received`."""
        slices = job.flat.chunk(len(job.received))
        return _post_pairs(job, job.tag, send=lambda j: slices[j], recv=lambda j: job.received[j])

    @staticmethod
    def _sum(job: ExactBucket) -> None:
        """My slice summed over the holders in holder order, rounded once into the result, and
        the rounded values' sum of squares into `job.norm`, chunk by chunk through the scratch
        (which stays in cache: one pass over the slice's memory for the three)."""
        mine = job.flat.chunk(len(job.received))[job.me]
        parts = [mine if buf is None else buf for buf in job.received]
        result = job.result.chunk(len(job.received))[job.me]
        if job.norm is not None:
            job.norm.zero_()
        step = job.scratch.numel()
        for start in range(0, result.numel(), step):
            end = min(start + step, result.numel())
            wide = job.scratch[: end - start]
            torch.add(parts[0][start:end], parts[1][start:end], out=wide)
            for part in parts[2:]:
                wide.add_(part[start:end])
            rounded = result[start:end]
            rounded.copy_(wide)
            if job.norm is not None:
                wide.copy_(rounded)
                job.norm.add_(torch.dot(wide, wide))

    @staticmethod
    def _post_second(job: ExactBucket) -> list[dist.Work]:
        """My rounded slice to each other holder; theirs into their slices of the result."""
        results = job.result.chunk(len(job.received))
        return _post_pairs(job, job.tag + 1, send=lambda _: results[job.me], recv=lambda j: results[j])


def _post_pairs(
    job: ExactBucket, tag: int, *, send: Callable[[int], torch.Tensor], recv: Callable[[int], torch.Tensor | None]
) -> list[dist.Work]:
    """A receive into `recv(j)` and a send of `send(j)` with every other holder j, posted at once."""
    works = []
    for j in range(len(job.received)):
        if j != job.me:
            into = recv(j)
            assert into is not None
            works.append(_p2p("recv", into, job, j, tag))
            works.append(_p2p("send", send(j), job, j, tag))
    return works


def _p2p(op: str, tensor: torch.Tensor, job: ExactBucket, peer: int, tag: int) -> dist.Work:
    """Post a send or receive of `tensor` with holder `peer` (the first one with a peer connects
    to it first, inside the call: this thread may block there, the training thread does not)."""
    if op == "send":
        work = dist.isend(tensor, group=job.group, group_dst=peer, tag=tag)
    else:
        work = dist.irecv(tensor, group=job.group, group_src=peer, tag=tag)
    assert work is not None
    return work
