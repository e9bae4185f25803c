"""A hard abort through the recording group (real Trainers on threads, gloo, every communicator
recording): it aborts every communicator of the generation, nothing is posted on an aborted one
afterwards, the next generation's first commit shuts the retired ones down, and the whole log
keeps NCCL's rules. A generation replaced without an abort is retired the same way, unaborted."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from elastic.comm import Event, Recorder
from elastic.comm.nccl_model import check
from elastic.engine.trainer import Trainer
from elastic.parallel.abort import AbortSignal, StepAborted
from elastic.parallel.shard_moves import plan_moves
from elastic.records.job import JobSpec
from templates.plan import PipelinePlan, Plan, StagePlan
from tests.comm.cluster import OPTIM
from tests.comm.cluster import SHAPE as SIX_LAYERS
from tests.comm.support import on_threads

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SHAPE = dataclasses.replace(SIX_LAYERS, n_layer=2)
LAYERS = SHAPE.num_layers

PLAN1 = Plan(num_layers=LAYERS, microbatch_size=1, gpus_per_node=1, fault_tolerance=1, pipelines=(
    PipelinePlan(stages=(StagePlan(node=0, layers=(0, 2)), StagePlan(node=1, layers=(2, 4))), microbatches=4),
    PipelinePlan(stages=(StagePlan(node=2, layers=(0, 3)), StagePlan(node=3, layers=(3, 4))), microbatches=4),
))
PLAN2 = Plan(num_layers=LAYERS, microbatch_size=1, gpus_per_node=1, fault_tolerance=0, pipelines=(
    PipelinePlan(stages=(StagePlan(node=2, layers=(0, 1)), StagePlan(node=0, layers=(1, 3)),
                         StagePlan(node=1, layers=(3, 4))), microbatches=8),
))


def _comms(log: list[Event], generation: int) -> set[str]:
    return {e.comm for e in log if e.kind == "create" and e.comm is not None and e.comm.startswith(f"g{generation}/")}


def _ended(log: list[Event], kind: str) -> dict[str, int]:
    """Communicator -> where in the log it was aborted (or shut down)."""
    return {e.comm: i for i, e in reversed(list(enumerate(log))) if e.kind == kind and e.comm is not None}


def _trainers(tmp_path: Path) -> tuple[list[Trainer], list[Recorder], list[AbortSignal]]:
    spec = JobSpec(model="tiny", shape=SHAPE, plan=PLAN1, steps=4, run_dir=str(tmp_path), optim=OPTIM, device="cpu",
                   collective_timeout_s=60)
    recorders = [Recorder(rank=n) for n in range(4)]
    trainers = [Trainer(spec, node=n, local_rank=0, recorder=recorders[n]) for n in range(4)]
    aborts = [AbortSignal() for _ in range(4)]
    store = dist.HashStore()
    started = on_threads(4, lambda n: trainers[n].start(plan=PLAN1, generation=1, store=store, abort=aborts[n],
                                                        fetch=None, step=0))
    assert not any(isinstance(s, BaseException) for s in started), started
    assert all(r.step == 0 for r in on_threads(4, lambda n: trainers[n].commit(trainers[n].prepare_step())))
    return trainers, recorders, aborts


def _next_generation(trainers: list[Trainer], survivors: list[int]) -> None:
    store = dist.HashStore()
    moves = plan_moves(PLAN2, {rank: trainers[node].holdings() for rank, node in enumerate((2, 0, 1))})
    started = on_threads(3, lambda i: trainers[survivors[i]].start(
        plan=PLAN2, generation=2, store=store, abort=AbortSignal(), fetch=None, step=1, moves=moves))
    assert all(not isinstance(s, BaseException) for s in started), started
    for _ in range(2):
        done = on_threads(3, lambda i: trainers[survivors[i]].commit(trainers[survivors[i]].prepare_step()))
        assert all(not isinstance(d, BaseException) for d in done), done


def _wait_for_shutdowns(recorders: list[Recorder], survivors: list[int]) -> None:
    """The retired communicators are closed on a thread after generation 2's first commit."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        logs = {n: recorders[n].snapshot() for n in survivors}
        if all(_comms(logs[n], 1) <= set(_ended(logs[n], "shutdown")) for n in survivors):
            return
        time.sleep(0.05)
    raise AssertionError("generation 1's communicators were not all shut down after generation 2's first commit")


def test_a_hard_abort_aborts_every_communicator_of_the_generation(tmp_path: Path) -> None:
    trainers, recorders, aborts = _trainers(tmp_path)
    survivors = [0, 1, 2]  # node 3 is lost: it posts nothing more
    def lose_node_3() -> None:
        for n in survivors:
            aborts[n].set("lost node(s) [3]")

    threading.Timer(0.3, lose_node_3).start()
    outcomes = on_threads(3, lambda i: trainers[survivors[i]].prepare_step())
    assert all(isinstance(o, StepAborted) for o in outcomes), outcomes
    for n in survivors:
        log = recorders[n].snapshot()
        made, aborted = _comms(log, 1), _ended(log, "abort")
        assert made and made <= set(aborted), f"node {n}: created {made}, aborted {set(aborted)}"
        late = [str(e) for i, e in enumerate(log) if e.kind == "post" and e.comm in aborted and i > aborted[e.comm]]
        assert not late, f"node {n} posted on aborted communicators: {late}"
        assert all(trainers[n].groups.world.aborted for n in survivors)

    _next_generation(trainers, survivors)
    _wait_for_shutdowns(recorders, survivors)
    logs = {n: recorders[n].snapshot() for n in range(4)}
    report = check(logs)
    assert report.ok, report.describe()
    for t in trainers:
        t.shutdown()


def test_a_generation_replaced_without_an_abort_is_retired_unaborted(tmp_path: Path) -> None:
    trainers, recorders, _ = _trainers(tmp_path)
    survivors = [0, 1, 2]  # node 3 left at a step boundary (a drain): nothing was abandoned
    _next_generation(trainers, survivors)
    _wait_for_shutdowns(recorders, survivors)
    logs = {n: recorders[n].snapshot() for n in range(4)}
    assert not any(e.kind == "abort" for n in survivors for e in logs[n])
    report = check(logs)
    assert report.ok, report.describe()
    for t in trainers:
        t.shutdown()


def test_an_abort_callback_that_raises_is_logged_and_the_step_abandoned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A callback of the abort that raises (NCCL's abort can, after waiting out its timeout) is
    logged on the thread that made the abort hard, the callbacks after it still run, and every
    survivor's step ends in StepAborted, not in the callback's error; the job goes on."""
    trainers, recorders, aborts = _trainers(tmp_path)
    survivors = [0, 1, 2]
    ran: list[int] = []

    def broken() -> None:
        raise RuntimeError("the backend's abort timed out")

    for n in survivors:
        aborts[n].on_hard(broken)
        aborts[n].on_hard(functools.partial(ran.append, n))
    lose_node_3 = threading.Timer(0.3, lambda: [aborts[n].set("lost node(s) [3]") for n in survivors])
    with caplog.at_level(logging.ERROR, logger="elastic.parallel.abort"):
        lose_node_3.start()
        outcomes = on_threads(3, lambda i: trainers[survivors[i]].prepare_step())
        lose_node_3.join(10)  # a step ends once its flag is set, maybe before the callbacks ran
    assert all(isinstance(o, StepAborted) for o in outcomes), outcomes
    assert sorted(ran) == survivors
    failed = [r for r in caplog.records if "abort callback failed" in r.getMessage()]
    assert len(failed) == 3 and all("the backend's abort timed out" in (r.exc_text or "") for r in failed), failed
    assert all(trainers[n].groups.world.aborted for n in survivors)
    _next_generation(trainers, survivors)
    _wait_for_shutdowns(recorders, survivors)
    report = check({n: recorders[n].snapshot() for n in range(4)})
    assert report.ok, report.describe()
    for t in trainers:
        t.shutdown()
