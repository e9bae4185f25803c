"""The vote: a worker whose wait on a step's vote is cut short keeps the reduced gradients, and
completing the step with the vote a peer saw gives bit-for-bit the state of the run where
nothing happened. Two real trainers on a real gloo world (threads of this process)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic.engine.step import PreparedStep, VoteCutShort
from elastic.engine.trainer import Trainer
from elastic.parallel.abort import AbortSignal
from elastic.records.job import JobSpec
from templates.plan import even_plan
from tests.comm.support import on_threads
from tests.engine.runs import OPTIM
from tests.engine.test_transaction import assert_same, snapshot

pytestmark = pytest.mark.timeout(120)

VOTE = 4 + 2 * 3
"""Float64s of a step's vote: norm, loss, failures, halts, and forward, backward and wait seconds
per node of the two."""


def _pair(tmp_path: Path, aborts: list[AbortSignal | None]) -> list[Trainer]:
    """Two workers: 2 pipelines x 1 stage of `tiny` (each holds every layer; buckets are reduced
    across both), started in two threads on one HashStore."""
    plan = even_plan(num_layers=6, nodes=[0, 1], num_pipelines=2, global_microbatches=4, microbatch_size=2)
    spec = JobSpec(model="tiny", plan=plan, steps=3, run_dir=str(tmp_path), optim=OPTIM, device="cpu")
    trainers = [Trainer(spec, node=n, local_rank=0) for n in (0, 1)]
    store = dist.HashStore()
    _both(lambda r: trainers[r].start(plan=plan, generation=1, store=store, abort=aborts[r], fetch=None, step=0))
    return trainers


def _both(fn: Callable[[int], Any]) -> list[Any]:
    """fn(0) and fn(1) in threads named rank0 and rank1; their results (or raised exceptions)."""
    return on_threads(2, fn)


def test_a_vote_cut_short_completes_to_the_state_of_the_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = _pair(tmp_path / "ref", [None, None])
    _both(lambda r: reference[r].train(2))
    expected = snapshot(reference[0])

    abort = AbortSignal()
    trainers = _pair(tmp_path / "cut", [None, abort])
    real_all_reduce = dist.all_reduce
    armed = {"on": True}

    def cut_rank1_vote(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # Rank 1 sends its vote (the world all-reduce of VOTE float64s), then is told to abort
        # before it sees the result: exactly a survivor whose wait a halt cut short.
        work = real_all_reduce(tensor, *args, **kwargs)
        vote = tensor.dtype == torch.float64 and tensor.numel() == VOTE
        if vote and armed["on"] and threading.current_thread().name == "rank1":
            armed["on"] = False
            abort.set("test: halted during the vote")
        return work

    monkeypatch.setattr(dist, "all_reduce", cut_rank1_vote)
    prepared = _both(lambda r: trainers[r].prepare_step())
    monkeypatch.setattr(dist, "all_reduce", real_all_reduce)
    assert isinstance(prepared[0], PreparedStep), prepared[0]
    assert isinstance(prepared[1], VoteCutShort), prepared[1]
    assert trainers[1].pending == 0 and trainers[1].step == 0

    seen = trainers[0].commit(prepared[0])
    done = trainers[1].complete_pending(grad_norm=seen.grad_norm, loss=seen.loss)
    assert (done.step, done.loss, done.grad_norm, done.lr) == (seen.step, seen.loss, seen.grad_norm, seen.lr)
    assert trainers[1].pending is None and trainers[1].step == 1
    assert_same(snapshot(trainers[0]), snapshot(trainers[1]))

    # The hard abort ended generation 1 (its communicators are aborted): as a real worker does,
    # both move to a generation 2 of the same plan, and its next step is the uninterrupted run's.
    assert trainers[1].groups.world.aborted
    plan, store = trainers[0].layout.plan, dist.HashStore()
    _both(lambda r: trainers[r].start(plan=plan, generation=2, store=store, abort=None, fetch=None, step=1))
    _both(lambda r: trainers[r].train(2))
    assert_same(snapshot(trainers[0]), expected)
    assert_same(snapshot(trainers[1]), expected)


def test_dropping_a_pending_step_leaves_the_state_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    abort = AbortSignal()
    trainers = _pair(tmp_path, [None, abort])
    before = snapshot(trainers[1])
    real_all_reduce = dist.all_reduce

    def cut(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = real_all_reduce(tensor, *args, **kwargs)
        if tensor.dtype == torch.float64 and tensor.numel() == VOTE and threading.current_thread().name == "rank1":
            abort.set("test")
        return work

    monkeypatch.setattr(dist, "all_reduce", cut)
    prepared = _both(lambda r: trainers[r].prepare_step())
    assert isinstance(prepared[1], VoteCutShort) and trainers[1].pending == 0
    trainers[1].discard()
    assert trainers[1].pending is None
    assert_same(snapshot(trainers[1]), before)
    assert all(p.grad is None for p in trainers[1].module.parameters())


def test_a_halt_voted_by_one_worker_is_agreed_by_all(tmp_path: Path) -> None:
    trainers = _pair(tmp_path, [None, None])
    first = _both(lambda r: trainers[r].prepare_step(halt=False))
    assert [p.halt for p in first] == [False, False]
    _both(lambda r: trainers[r].commit(first[r]))
    second = _both(lambda r: trainers[r].prepare_step(halt=r == 1))
    assert [p.halt for p in second] == [True, True], "every worker stops after the same step"


def test_a_halt_asked_for_while_the_step_computes_stops_after_that_step(tmp_path: Path) -> None:
    """A worker's halt wish is asked right before its vote, not when the step starts: a halt that
    arrives during the step (here: at rank 1's first forward) stops every worker after this step,
    not after the next one. The reference: the same wish, never raised, votes no halt."""
    trainers = _pair(tmp_path, [None, None])
    asked = threading.Event()
    quiet = _both(lambda r: trainers[r].prepare_step(halt=asked.is_set))
    assert [p.halt for p in quiet] == [False, False]
    _both(lambda r: trainers[r].commit(quiet[r]))
    hook = trainers[1].module.register_forward_hook(lambda *_: asked.set())
    try:
        during = _both(lambda r: trainers[r].prepare_step(halt=asked.is_set if r == 1 else False))
    finally:
        hook.remove()
    assert [p.halt for p in during] == [True, True], "the halt that came during the step ends it"


def test_every_worker_learns_every_nodes_phases_from_the_vote(tmp_path: Path) -> None:
    """Each node's forward, backward and wait seconds travel in the vote: both workers see the same
    figures for both nodes, each node's own (its schedule did forward and backward passes), and a
    node's busy time is its forward plus backward."""
    trainers = _pair(tmp_path, [None, None])
    prepared = _both(lambda r: trainers[r].prepare_step())
    assert prepared[0].phases == prepared[1].phases
    assert sorted(prepared[0].phases) == [0, 1]
    for phases in prepared[0].phases.values():
        assert phases.forward > 0 and phases.backward > 0 and phases.wait >= 0
        assert phases.busy == phases.forward + phases.backward
