"""Abandoning a step on the control plane's word: an abort flag and an abortable wait.

gloo cannot cancel a pending operation, and `work.wait(timeout)` closes the connection pair
when it times out, so it cannot be used to poll. Worse, a gloo send or receive never reports
`is_completed()` until someone calls `wait()` on it (measured with torch 2.13: a receive whose
data has arrived still reports False). So a blocking `work.wait()` runs on a waiter thread
owned by the AbortSignal, and the caller waits for that thread's completion event while
checking the abort flag every couple of milliseconds. When the flag is set the caller raises
StepAborted and leaves the waiter thread blocked on the abandoned operation; it ends when the
operation fails (peer gone, group timeout). Each generation has its own AbortSignal, hence its
own waiter thread, so an abandoned wait never delays the next generation.

An abort is hard (every wait raises) or local (`set(reason, local=True)`): a failure outside
this worker's pipeline. A local abort lets the waits of the step's own pipeline (point-to-point
transfers with its stages, tensor-parallel collectives inside its node: `wait_work(...,
local=True)`) run to completion, so the pipeline finishes its microbatches and keeps their
gradients for the next generation (partial replay); every other wait raises at once. A later
hard `set` upgrades a local abort, and so does the local grace running out (`local_grace_s`
after the local abort): a pipeline peer that stopped for another reason cannot keep the
others waiting for longer than that.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

_T = TypeVar("_T")

_ABORT_POLL_S = 0.002
"""How often a waiting caller checks the abort flag while the operation is pending."""


class StepAborted(RuntimeError):
    """A step abandoned because the control plane said so (a peer failed or hung)."""


class _Pending:
    """One blocking call handed to the waiter thread (a work's wait, or a post that connects)."""

    __slots__ = ("fn", "done", "error", "result")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.result: Any = None


class AbortSignal:
    """The abort flag of one generation, settable from any thread, with its waiter thread."""

    def __init__(self, *, local_grace_s: float | None = None) -> None:
        """`local_grace_s`: how long after a local abort the waits inside the pipeline may go
        on (None: until a hard abort)."""
        self._event = threading.Event()
        self._hard = threading.Event()
        self.local_grace_s = local_grace_s
        self._local_since: float | None = None
        self._reason: str | None = None
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Pending] | None = None

    def set(self, reason: str, *, local: bool = False) -> None:
        """Abort the current step (idempotent: the first reason is kept). `local`: the failure
        is outside this worker's pipeline, whose own waits may complete (module doc)."""
        with self._lock:
            if self._reason is None or (not local and not self._hard.is_set()):
                self._reason = reason
        if not local:
            self._hard.set()
        elif self._local_since is None:
            self._local_since = time.monotonic()
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def is_hard(self) -> bool:
        """Whether every wait must end now (False for a local abort within its grace, or none)."""
        if self._hard.is_set():
            return True
        since, grace = self._local_since, self.local_grace_s
        if since is not None and grace is not None and time.monotonic() - since > grace:
            self.set(f"{self._reason}; the pipeline did not finish its microbatches within {grace:.0f} s")
            return True
        return False

    @property
    def reason(self) -> str | None:
        """Why the step was aborted; None while it is not."""
        return self._reason

    def _submit(self, fn: Callable[[], Any]) -> _Pending:
        with self._lock:
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                threading.Thread(
                    target=self._serve, args=(self._queue,), name="abortable-wait", daemon=True
                ).start()
            pending = _Pending(fn)
            self._queue.put(pending)
        return pending

    @staticmethod
    def _serve(jobs: queue.SimpleQueue[_Pending]) -> None:
        while True:
            job = jobs.get()
            try:
                job.result = job.fn()
            except BaseException as exc:  # handed to the caller, which re-raises it
                job.error = exc
            job.done.set()


def _raise_aborted(abort: AbortSignal) -> None:
    raise StepAborted(f"step aborted: {abort.reason}")


def wait_work(work: dist.Work, abort: AbortSignal | None, *, local: bool = False) -> None:
    """Wait for `work`; raise StepAborted if `abort` is set before it completes (with `local`,
    an operation inside this worker's pipeline: only if the abort is hard).

    With `abort=None` this is `work.wait()`. An error of the operation itself (a peer reset
    the connection, the group timed out) propagates as raised by `work.wait()`.
    """
    if abort is None:
        work.wait()
        return
    stop = abort.is_hard if local else abort.is_set
    if stop():
        _raise_aborted(abort)
    if work.is_completed():  # collectives report completion asynchronously: no thread hop
        work.wait()
        return
    _on_waiter(work.wait, abort, stop)


def call_abortable(fn: Callable[[], _T], abort: AbortSignal | None, *, local: bool = False) -> _T:
    """`fn()` run on the abort's waiter thread, waited for like `wait_work` waits: for a call
    that may block in C++ with no way to cancel it (a gloo send or receive posted to a peer for
    the first time connects to it first, and a dead peer keeps it connecting until the group's
    timeout). StepAborted when `abort` is set first; the call is left behind on the thread."""
    if abort is None:
        return fn()
    stop = abort.is_hard if local else abort.is_set
    if stop():
        _raise_aborted(abort)
    result: _T = _on_waiter(fn, abort, stop)
    return result


def wait_event(event: threading.Event, abort: AbortSignal | None) -> None:
    """Wait until `event` is set, by another thread of this worker that does a step's transfers
    (`elastic.parallel.exchange`); StepAborted if `abort` is set first."""
    if abort is None:
        event.wait()
        return
    _poll(event, abort, abort.is_set)


def _poll(event: threading.Event, abort: AbortSignal, stop: Callable[[], bool]) -> None:
    """Wait until `event` is set, checking `stop` every _ABORT_POLL_S: StepAborted once it says so."""
    while not event.wait(_ABORT_POLL_S):
        if stop():
            _raise_aborted(abort)


def _on_waiter(fn: Callable[[], Any], abort: AbortSignal, stop: Callable[[], bool]) -> Any:
    pending = abort._submit(fn)
    _poll(pending.done, abort, stop)
    if pending.error is not None:
        raise pending.error
    return pending.result
