"""Abandoning work on real gloo communicators (threads of this process): a wait that ends in a
backend error once the generation was aborted is abandonment (StepAborted), on the NCCL path
(inline waits) and on gloo's (a waiter thread), while the same error with no abort propagates;
a communicator is never shut down with work pending (it is aborted first, and the model of NCCL
passes the log), while a log that shuts one down with work pending is reported; a backend abort
that raises is logged on its own thread, and the caller goes on."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import torch

from elastic.comm import P2P, Communicator, Handle, Recorder
from elastic.comm.nccl_model import check
from elastic.parallel import abort as abort_module
from elastic.parallel.abort import AbortSignal, StepAborted, wait_work
from tests.comm.support import gloo_comms
from tests.leftover_threads import generation_threads, left_behind

pytestmark = pytest.mark.timeout(60)


def _unmatched_receive(comm: Communicator, *, inline: bool) -> Handle:
    """A receive nobody sends to; `inline`: waited as NCCL's are (no waiter thread)."""
    handle = comm.post([P2P("recv", torch.empty(4), 1)])
    handle.host_blocking = not inline
    return handle


@pytest.mark.parametrize("inline", [True, False], ids=["nccl-path", "gloo-path"])
def test_a_wait_that_fails_after_an_abort_is_abandonment(inline: bool) -> None:
    """The abort's callback closes the group (as NCCL's abort ends its kernels), which makes the
    pending wait raise a backend error: the caller gets StepAborted, its wait logged abandoned."""
    recorder = Recorder(rank=0)
    comms = gloo_comms(2, name="g1/world", recorders=[recorder, None])
    handle = _unmatched_receive(comms[0], inline=inline)
    abort = AbortSignal()
    abort.on_hard(comms[0].shutdown)
    threading.Timer(0.2, abort.set, args=("lost node(s) [1]",)).start()
    with pytest.raises(StepAborted, match=r"lost node\(s\) \[1\]") as raised:
        wait_work(handle, abort)
    if inline:  # the wait itself failed: the backend's error is the cause
        assert isinstance(raised.value.__cause__, RuntimeError), raised.value.__cause__
    waits = [e for e in recorder.snapshot() if e.kind == "wait"]
    assert [(w.ids, w.abandoned) for w in waits] == [(handle.ids, True)]
    comms[1].shutdown()


def test_the_same_failure_without_an_abort_is_an_error() -> None:
    comms = gloo_comms(2, name="g1/world")
    handle = _unmatched_receive(comms[0], inline=True)
    threading.Timer(0.2, comms[0].shutdown).start()
    with pytest.raises(RuntimeError) as raised:
        wait_work(handle, AbortSignal())
    assert not isinstance(raised.value, StepAborted)
    comms[1].shutdown()


def test_a_communicator_with_work_pending_is_aborted_before_its_shutdown(caplog: pytest.LogCaptureFixture) -> None:
    recorders = [Recorder(rank=r) for r in range(2)]
    comms = gloo_comms(2, name="g1/world", recorders=recorders)
    _unmatched_receive(comms[0], inline=False)
    with caplog.at_level(logging.WARNING, logger="elastic.comm.communicator"):
        assert comms[0].shutdown()
    assert any("pending: aborted instead" in r.getMessage() for r in caplog.records)
    comms[1].shutdown()
    logs = {r: recorders[r].snapshot() for r in range(2)}
    assert [e.kind for e in logs[0] if e.kind in ("abort", "shutdown")] == ["abort", "shutdown"]
    report = check(logs)
    assert report.ok, report.describe()
    # The same log without the abort: a live communicator retired with work pending.
    unaborted = {0: [e for e in logs[0] if e.kind != "abort"], 1: logs[1]}
    report = check(unaborted)
    assert any("shut down (not aborted) with operations pending" in p for p in report.problems), report.describe()


def test_a_communicator_with_nothing_pending_is_shut_down_unaborted() -> None:
    recorders = [Recorder(rank=r) for r in range(2)]
    comms = gloo_comms(2, name="g1/world", recorders=recorders)
    handles = [comms[r].post([P2P("send" if r == 0 else "recv", torch.ones(4), 1 - r)]) for r in range(2)]
    for h in handles:
        h.wait()
    for c in comms:
        assert c.pending() == 0
        assert c.shutdown()
    logs = {r: recorders[r].snapshot() for r in range(2)}
    assert not any(e.kind == "abort" for log in logs.values() for e in log)
    assert check(logs).ok


class _FailingAbort:
    """A real gloo group whose abort raises, as NCCL's can after waiting out its timeout."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self.aborted_on: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)

    def abort(self) -> None:
        self.aborted_on = threading.current_thread().name
        raise RuntimeError("NCCL communicator abort timed out")


def test_a_backend_abort_that_raises_is_logged_on_its_own_thread(caplog: pytest.LogCaptureFixture) -> None:
    base = gloo_comms(1, name="g1/0")[0]
    group = _FailingAbort(base.group)
    comm = Communicator(group, name="g1/0", members=[0], backend="nccl",  # type: ignore[arg-type]
                        device=torch.device("cpu"), abort_join_s=5)
    with caplog.at_level(logging.WARNING, logger="elastic.comm.communicator"):
        comm.abort()  # returns at once: the backend's abort runs on a thread of its own
        assert comm.aborted
        assert comm.shutdown()  # waits for the abort's thread
    assert group.aborted_on == "abort g1/0"
    assert isinstance(comm.abort_error, RuntimeError)
    assert any("the backend's abort raised RuntimeError" in r.getMessage() for r in caplog.records)
    base.shutdown()


def test_a_generations_waiter_ends_when_idle_and_keeps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each generation has its own abort flag, and with it a waiter thread for gloo's waits.
    Once idle it ends, and between waits it holds nothing of the last one: a finished wait's
    work keeps its group's gloo context, and that context's TCP loop thread, alive (before, every
    worker kept one such pair a generation for good)."""
    monkeypatch.setattr(abort_module, "WAITER_IDLE_EXIT_S", 0.3)
    before = generation_threads()
    comms = gloo_comms(2, name="g1/world")
    abort = AbortSignal()
    handles = [comms[r].post([P2P("send" if r == 0 else "recv", torch.ones(4), 1 - r)]) for r in range(2)]
    for h in handles:
        assert h.host_blocking
        wait_work(h, abort)  # on the waiter thread (gloo)
    assert generation_threads()["abortable-wait"] == 1 + before["abortable-wait"]
    del handles, comms, h  # the generation is over: only the flag (held by the worker) lives on
    left = left_behind(before, within_s=5.0)
    assert not left, f"still there with the generation's groups dropped: {dict(left)}"
    again = gloo_comms(2, name="g2/world")  # a flag's waiter starts again for a later wait
    handles = [again[r].post([P2P("send" if r == 0 else "recv", torch.ones(4), 1 - r)]) for r in range(2)]
    for h in handles:
        wait_work(h, abort)
    for c in again:
        c.shutdown()
