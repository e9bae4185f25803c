"""Abandoning a step on the control plane's word: an abort flag, abortable waits, and the
communicators' abort.

gloo (CPU) cannot cancel a pending operation, and `work.wait(timeout)` closes the connection
pair when it times out, so it cannot be used to poll. Worse, a gloo send or receive never reports
`is_completed()` until someone calls `wait()` on it (measured with torch 2.13: a receive whose
data has arrived still reports False). So on gloo a blocking wait runs on a waiter thread owned
by the AbortSignal, and the caller waits for that thread's completion event while checking the
abort flag every couple of milliseconds. When the flag is set the caller raises StepAborted and
leaves the waiter thread blocked on the abandoned operation; it ends when the operation fails
(peer gone, the group closed). Each generation has its own AbortSignal, hence its own waiter
thread, so an abandoned wait never delays the next generation. A waiter with nothing to wait
for ends after WAITER_IDLE_EXIT_S.

NCCL (CUDA) is the other way round: `wait()` returns at once (the current stream waits), so a
step's waits are made inline, and the host blocks only where it reads a value back
(`fetch`: the vote, a loss, an evaluation), which polls a CUDA event abortably. A dead peer
leaves kernels spinning on the GPU that no flag can stop: a hard abort therefore runs the
generation's abort callbacks (`on_hard`), which abort its communicators (the backend's abort on a
thread of its own, so the caller cannot hang on it; elastic/comm/communicator.py); the kernels
then end and the streams drain. A callback that raises is logged, not raised, and a wait that
ends in an error once the abort is set (NCCL's backend error after the abort) is abandonment:
StepAborted, like every other wait of an aborted step.

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

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from elastic.comm import Handle, current_lane, lane_as
from elastic.comm.device import to_host

_T = TypeVar("_T")

log = logging.getLogger(__name__)

_ABORT_POLL_S = 0.002
"""How often a waiting caller checks the abort flag while the operation is pending."""

WAITER_IDLE_EXIT_S = 5.0
"""How long the waiter thread waits for a call before it ends: a retired generation's waiter
does not outlive its last wait by more than that (unless that wait never ends: module doc)."""


class StepAborted(RuntimeError):
    """A step abandoned because the control plane said so (a peer failed or hung)."""


class _Pending:
    """One blocking call handed to the waiter thread (a work's wait, or a post that connects)."""

    __slots__ = ("fn", "lane", "done", "error", "result")

    def __init__(self, fn: Callable[[], Any], lane: str) -> None:
        self.fn = fn
        self.lane = lane
        """The caller's lane: a recording group logs the call there (elastic/comm/record.py)."""
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
        self._on_hard: list[Callable[[], None]] = []
        self._hard_done = False

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
        if not local:
            self._run_hard_callbacks()

    def on_hard(self, callback: Callable[[], None]) -> None:
        """Call `callback` once when the abort becomes hard (at once if it is already): the
        generation's communicators abort there. Runs on the thread that makes it hard; what it
        raises is logged, never raised there (that thread may be a control-plane feed's)."""
        with self._lock:
            now = self._hard_done
            if not now:
                self._on_hard.append(callback)
        if now:
            try:
                callback()
            except Exception:
                log.exception("an abort callback failed (%s); the step is abandoned all the same", self._reason)

    def _run_hard_callbacks(self) -> None:
        with self._lock:
            if self._hard_done:
                return
            self._hard_done = True
            callbacks, self._on_hard = self._on_hard, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # the step is abandoned all the same: the flag is set, every wait ends
                log.exception("an abort callback failed (%s); the step is abandoned all the same", self._reason)

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
            pending = _Pending(fn, current_lane())
            self._queue.put(pending)
        return pending

    def _serve(self, jobs: queue.SimpleQueue[_Pending]) -> None:
        """Run the handed calls in order; end after WAITER_IDLE_EXIT_S without one (the next
        `_submit` starts a new thread). Between calls the thread holds nothing of the last one:
        a finished wait's work keeps its group's gloo context, and with it that group's TCP loop
        thread, alive for as long as anything references it."""
        while True:
            try:
                job = jobs.get(timeout=WAITER_IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:  # `_submit` puts under the lock: nothing can slip in between
                    if jobs.empty():
                        self._queue = None
                        return
                continue
            try:
                with lane_as(job.lane):
                    job.result = job.fn()
            except BaseException as exc:  # handed to the caller, which re-raises it
                job.error = exc
            job.done.set()
            del job


def _raise_aborted(abort: AbortSignal) -> None:
    raise StepAborted(f"step aborted: {abort.reason}")


def wait_work(work: Handle, abort: AbortSignal | None, *, local: bool = False) -> None:
    """Wait for `work`; raise StepAborted if `abort` is set before it completes (with `local`,
    an operation inside this worker's pipeline: only if the abort is hard).

    With `abort=None`, or on NCCL (whose wait does not block the host: module doc), this is
    `work.wait()`. An error of the operation itself (a peer reset the connection, the group
    timed out) propagates as raised by the wait, unless the abort is set by then: the error is
    the abort's doing (NCCL's `wait` raises a backend error once its communicator was aborted,
    gloo's once the group was closed), and the step is abandoned (StepAborted), not crashed.
    """
    if abort is None:
        work.wait()
        return
    stop = abort.is_hard if local else abort.is_set
    if stop():
        work.note_waited(abandoned=True)
        _raise_aborted(abort)
    try:
        if not work.host_blocking or work.is_completed():  # NCCL; or done already: no thread hop
            work.complete()
        else:
            _on_waiter(work.complete, abort, stop)
    except StepAborted:
        work.note_waited(abandoned=True)
        raise
    except Exception as exc:
        if not abort.is_set():
            raise
        work.note_waited(abandoned=True)
        raise StepAborted(f"step aborted: {abort.reason} (the wait ended with {type(exc).__name__}: {exc})") from exc
    work.note_waited()


def fetch(tensor: torch.Tensor, abort: AbortSignal | None) -> torch.Tensor:
    """`tensor` on the host, for reading its values: on CUDA the copy waits for the kernels
    (and communication) before it, polled abortably (StepAborted when `abort` is set first);
    on CPU the tensor itself."""
    host, ready = to_host(tensor)
    if abort is None:
        while not ready():
            time.sleep(_ABORT_POLL_S / 4)
        return host
    while not ready():
        if abort.is_set():
            _raise_aborted(abort)
        time.sleep(_ABORT_POLL_S / 4)
    return host


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
