"""The tree-order bucket exchange of a worker's steps, run on a thread of its own.

A bucket's block sums (elastic/parallel/blocks.py) are reduced with the step's one summation
tree in two phases of point-to-point transfers on its bucket communicator: every holder sends
slice j of each of its blocks' sums to holder j and receives its own slice of every other
holder's blocks; then it combines its slice of all the holders' blocks in tree order and sends
the result to every other holder, receiving theirs likewise (an all-gather). With one block per
holder that is the bytes of a float32 reduce-scatter and all-gather: DDP's all-reduce. While
the slice is in cache the holder also measures it (the sum of squares of the result): each
holder measures its own slice of every bucket, so the gradient norm costs each of them 1/P of
a pass, off the training thread.

NCCL's rules (elastic/comm/communicator.py) shape the posting. Each phase of a bucket is one
group holding all of its sends and receives, so two holders that send to each other both
progress (a receive posted alone before its send would wait forever on NCCL). And the thread
takes the buckets strictly one after another, in the order it was handed them (one global
order: descending layer): phase 1, its wait, the combine, phase 2, then the next bucket. So
every holder posts the same sequence of groups on a communicator whatever the timing: a thread
that posted the next bucket's first phase as soon as it arrived would, on another holder,
meet that bucket's second phase instead (NCCL ignores tags), and move the wrong bytes.

Run on the training thread, every part of this stalls the backward it should overlap: gloo
writes a posted send inline (megabytes of copying), the second phase waits for the peers'
first, and the combine is a pass over the slice. So the training thread only hands each bucket
over as its sums are final (`submit`, never blocks), and the exchange's thread posts, waits,
combines and posts again. DDP's all-reduce likewise runs on gloo's own thread. On CUDA the
thread works on a stream of its own, which waits for the training stream's gradients of each
bucket (an event recorded at `submit`) and which the training stream waits for at `finish`:
its waits never hold up the training thread's kernels. The thread is kept from step to step and
ends when it has been idle for a while (IDLE_EXIT_S).

`finish` waits for the thread abortably (StepAborted as soon as the generation's abort flag it
is given is set, like `groups.wait`) and re-raises its error on the training thread. An
abandoned exchange (an abort, a failed transfer, or the step failed elsewhere) never writes to
its buffers again: the thread checks that under a lock before every pass over them, and the
training thread takes the lock to abandon it. A thread left blocked on a dead peer's transfer
ends when that transfer fails (its communicator aborted or closed).

With the optimizer sharded, phase 2 sends each element of my slice only to the holders that
update it, as runs of the result (`TreeBucket.second`, elastic/engine/shard_reduce.py), and a
tensor-parallel rank above 0 measures only the runs it counts in the norm (`counted`).

With a recording group (elastic/comm/record.py) the thread records in a lane of its own, and
the hand-overs are logged as signals: a bucket's posts come after its `submit`, and `finish`
goes on after the thread's round.
"""

from __future__ import annotations

import itertools
import queue
import threading
from dataclasses import dataclass
from typing import Any

import torch

from elastic.comm import P2P, Communicator, Handle, Recorder, lane_as
from elastic.comm.device import bind_thread, mark, on_stream, side_stream, wait_mark
from elastic.parallel.abort import AbortSignal, StepAborted, wait_event
from elastic.parallel.blocks import Block, CombineProgram, combine, sum_of_squares


@dataclass(frozen=True)
class Span:
    """Elements [start, stop) of a bucket's result sent to, or received from, holder `peer`."""

    kind: str
    peer: int
    start: int
    stop: int


@dataclass(frozen=True, kw_only=True)
class SecondPhase:
    """A bucket's second phase under the sharded optimizer (`TreeBucket.second`, `.counted`)."""

    spans: tuple[Span, ...]
    counted: tuple[tuple[int, int], ...] | None


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
    group: Communicator
    """The bucket's communicator; holders are addressed by their rank in it."""
    me: int
    """My rank in the bucket group."""
    tag: int
    """Tag of the first phase; the second uses tag + 1."""
    second: tuple[Span, ...] | None = None
    """The sharded optimizer's second phase (issue 55): what of the result I send to and receive
    from whom, in posting order, each span a run of the result's elements; None: my slice to
    every other holder and theirs from each (an all-gather)."""
    counted: tuple[tuple[int, int], ...] | None = None
    """Runs of the result's elements that `norm` counts (None: all of my slice): with a second
    phase that leaves most of the result unreceived, a tensor-parallel rank above 0 measures its
    unique elements here, not after the reduction."""

    @property
    def holders(self) -> int:
        return len(self.blocks)


class _Round:
    """The end of one step's buckets: set once they are all complete on this worker."""

    __slots__ = ("done", "number", "event")

    def __init__(self, number: int) -> None:
        self.done = threading.Event()
        self.number = number
        self.event: Any = None
        """CUDA: recorded on the thread's stream once the round is complete (None on CPU)."""


@dataclass(frozen=True)
class _Job:
    """A bucket handed over, with the training stream's event of its sums (None on CPU)."""

    bucket: TreeBucket
    number: int
    ready: Any


SUM_CHUNK = 1 << 16
"""Elements combined and measured at a time (the scratch buffers' length). A slice-long work
buffer costs a write and a re-read of the whole slice from memory; in chunks of this size
the sum and the sum of squares take one pass over it (8 Ki to 128 Ki measured on this
project's CPU machine for the float64 sums of before: 64 Ki the fastest)."""

IDLE_EXIT_S = 5.0
"""How long the exchange thread waits for work before it ends (the next `submit` starts a new
one): a generation's thread does not outlive its steps by more than that."""


_LANES = itertools.count()


class TreeExchange:
    """The tree-order exchanges of one worker, step after step, on one thread (module doc).

    Each step `submit`s its buckets and then `finish`es them. The thread is kept from step to
    step (starting a thread, and ending one, each cost the step a few hundred microseconds) and
    ends after IDLE_EXIT_S without work. Once abandoned (`abandon`, an abort, or a failed
    transfer) an exchange takes no more work: the owner makes a new one (`abandoned`).
    """

    def __init__(self, *, device: torch.device | None = None, recorder: Recorder | None = None) -> None:
        """`device`: where the buckets live (CUDA: the thread gets a stream of its own);
        `recorder`: the worker's recording group, if any (module doc)."""
        self._jobs: queue.SimpleQueue[_Job | _Round] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._abandoned = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._submitted = 0
        self._rounds = 0
        self._device = device or torch.device("cpu")
        self._stream = side_stream(self._device)
        self._recorder = recorder
        self.lane = f"exchange-{next(_LANES)}"
        """The lane the thread records in."""

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
        self._submitted += 1
        number = self._submitted
        if self._recorder is not None:
            self._recorder.signal(f"{self.lane}/submit/{number}")
        self._put(_Job(bucket, number, mark(self._device)))

    def finish(self, abort: AbortSignal | None) -> None:
        """Wait until every bucket submitted since the last `finish` is complete on this worker
        (on CUDA: the calling thread's stream waits for them). StepAborted when `abort` (the
        generation's flag) is set first, the thread's error when a transfer failed; either way
        the exchange is abandoned."""
        if not self._submitted:
            return
        self._submitted = 0
        self._rounds += 1
        end = _Round(self._rounds)
        self._put(end)
        try:
            wait_event(end.done, abort)
        except StepAborted:
            self.abandon()
            raise
        if self._error is not None:
            raise self._error
        if self._recorder is not None:
            self._recorder.await_(f"{self.lane}/round/{end.number}")
        wait_mark(end.event)

    def abandon(self) -> None:
        """Stop: the thread touches no buffer from now on and ends as soon as it can."""
        with self._lock:
            self._abandoned = True

    def _put(self, item: _Job | _Round) -> None:
        with self._lock:  # the thread ends only under the lock, with nothing queued
            self._jobs.put(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tree-exchange", daemon=True)
                self._thread.start()

    def _next(self) -> _Job | _Round | None:
        """The next item handed over; None when the thread waited IDLE_EXIT_S for one and ends
        (`self._thread` cleared under the lock)."""
        while True:
            try:
                return self._jobs.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if self._jobs.empty():
                        self._thread = None
                        return None

    def _run(self) -> None:
        bind_thread(self._device)
        with lane_as(self.lane), on_stream(self._stream):
            self._serve()

    def _serve(self) -> None:
        second: list[Handle] = []
        posted: Handle | None
        item: _Job | _Round | None
        while True:
            item = self._next()
            if item is None:
                return  # idle: ended
            try:
                if isinstance(item, _Round):
                    if not self._abandoned:
                        for handle in second:
                            handle.wait()
                        if self._recorder is not None:
                            self._recorder.signal(f"{self.lane}/round/{item.number}")
                        item.event = mark(self._device)
                elif not self._abandoned:
                    if self._recorder is not None:
                        self._recorder.await_(f"{self.lane}/submit/{item.number}")
                    wait_mark(item.ready)
                    posted = self._exchange(item.bucket)
                    if posted is not None:
                        second.append(posted)
            except BaseException as exc:  # handed to `finish`; the exchange is done for
                with self._lock:
                    if self._error is None:
                        self._error = exc
                    self._abandoned = True
            if isinstance(item, _Round) or self._abandoned:
                second.clear()
            if isinstance(item, _Round):
                item.done.set()
            item = posted = None  # idle, the thread holds no work: a work keeps its group's gloo context alive
            if self._abandoned:
                with self._lock:  # it takes no more work: end now, not after IDLE_EXIT_S
                    if self._jobs.empty():
                        self._thread = None
                        return

    def _exchange(self, job: TreeBucket) -> Handle | None:
        """Phase 1 of `job` (one group), its wait, my slice combined, phase 2 posted (one group);
        phase 2's handle, or None once abandoned."""
        self._post_first(job).wait()
        with self._lock:
            if self._abandoned:
                return None
            self._sum(job)
        return self._post_second(job)

    @staticmethod
    def _post_first(job: TreeBucket) -> Handle:
        """One group: each other holder's slice of each of my blocks to it, its blocks of my slice
        into `received` (one message per block, in block order: a FIFO channel per pair)."""
        slices = [flat.chunk(job.holders) for flat in job.sums]
        ops: list[P2P] = []
        for j in range(job.holders):
            if j != job.me:
                into = job.received[j]
                assert into is not None and len(into) == len(job.blocks[j])
                ops.extend(P2P("recv", buf, j, job.tag) for buf in into)
                ops.extend(P2P("send", parts[j], j, job.tag) for parts in slices)
        return job.group.post(ops)

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
        counted = job.counted
        combine(blocks, parts, result, job.scratch, program=job.program,
                norm=job.norm if counted is None else None, wide=job.wide)
        if counted is not None and job.norm is not None:  # only the runs within my slice
            job.norm.zero_()
            lo, hi = job.me * result.numel(), (job.me + 1) * result.numel()
            for a, b in counted:
                if max(a, lo) < min(b, hi):
                    job.norm.add_(sum_of_squares(job.result[max(a, lo) : min(b, hi)], job.wide))

    @staticmethod
    def _post_second(job: TreeBucket) -> Handle:
        """One group: my slice of the result to each other holder; theirs into their slices of it."""
        if job.second is not None:
            return job.group.post([P2P(s.kind, job.result[s.start : s.stop], s.peer, job.tag + 1) for s in job.second])
        results = job.result.chunk(job.holders)
        ops: list[P2P] = []
        for j in range(job.holders):
            if j != job.me:
                ops.append(P2P("recv", results[j], j, job.tag + 1))
                ops.append(P2P("send", results[job.me], j, job.tag + 1))
        return job.group.post(ops)
