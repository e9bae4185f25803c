"""Partial replay in the engine, on a real gloo world (two trainers, threads of this process):
a worker whose pipeline finished step s keeps its gradient sums when the step is abandoned,
and a generation that computes only the other microbatches and adds them commits bit-for-bit
the step of the run where nothing happened. Local aborts let waits inside the pipeline finish;
hard ones and the local grace end them."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic.comm import P2P
from elastic.engine.generation import joined
from elastic.engine.step import replay_blocks
from elastic.parallel.abort import AbortSignal, StepAborted, wait_work
from elastic.parallel.blocks import Block
from elastic.parallel.layout import assign_ranks
from elastic.records.partial import PartialReport, ReplayRecord, resolve_replay
from templates.plan import PipelinePlan, Plan, StagePlan, even_plan
from tests.comm.support import gloo_comms
from tests.engine.test_transaction import assert_same, snapshot
from tests.engine.test_vote import _both, _pair

pytestmark = pytest.mark.timeout(120)


def test_kept_sums_plus_the_missing_microbatches_commit_the_failure_free_step(tmp_path: Path) -> None:
    reference = _pair(tmp_path / "ref", [None, None])
    _both(lambda r: reference[r].train(3))

    aborts = [AbortSignal(), AbortSignal()]
    trainers = _pair(tmp_path / "run", list(aborts))
    _both(lambda r: trainers[r].train(2))
    # Step 2: node 1 is lost before it joins; node 0's pipeline (itself) is intact.
    aborts[0].set("lost node(s) [1]", local=True)
    survivor = trainers[0]
    with pytest.raises(StepAborted):
        survivor.prepare_step()
    kept = survivor.kept
    assert kept is not None and kept.step == 2 and kept.microbatches == (0, 1) and kept.layers == (0, 6)
    assert all(p.grad is None for p in survivor.module.parameters())

    # Generation 2: node 0 alone; it keeps microbatches 0-1 and computes 2-3.
    alone = even_plan(num_layers=6, nodes=[0], num_pipelines=1, global_microbatches=4, microbatch_size=2)
    replay = ReplayRecord(step=2, total=4, set_runs=[[[0, 2]]], set_nodes=[[0]])
    survivor.start(plan=alone, generation=2, store=dist.HashStore(), abort=AbortSignal(), fetch=None, step=2,
                   replay=replay)
    assert joined(survivor._current).transaction.microbatches(2) == (2, 3)  # noqa: SLF001 - the replayed share
    (report,) = survivor.train(3)
    assert_same(snapshot(survivor), snapshot(reference[0]))
    assert report.loss == pytest.approx(reference[0].last_report.loss, rel=1e-12)  # type: ignore[union-attr]
    assert survivor.kept is None  # dropped once the step committed
    assert joined(survivor._current).transaction.microbatches(3) == (0, 1, 2, 3)  # noqa: SLF001 - later steps are whole


def test_a_keeper_without_its_sums_refuses_to_join(tmp_path: Path) -> None:
    trainers = _pair(tmp_path, [AbortSignal(), AbortSignal()])
    _both(lambda r: trainers[r].train(1))
    alone = even_plan(num_layers=6, nodes=[0], num_pipelines=1, global_microbatches=4, microbatch_size=2)
    replay = ReplayRecord(step=1, total=4, set_runs=[[[0, 2]]], set_nodes=[[0]])
    with pytest.raises(ValueError, match="counts on this worker's kept sums"):
        trainers[0].start(plan=alone, generation=2, store=dist.HashStore(), abort=None, fetch=None, step=1,
                          replay=replay)


def test_local_abort_lets_pipeline_waits_finish_until_hard_or_out_of_grace() -> None:
    a, b = gloo_comms(2, timeout_s=30)
    abort = AbortSignal()
    abort.set("lost node(s) [5]", local=True)
    buf = torch.zeros(4)
    # A transfer inside the pipeline completes despite the local abort (the peer sends 0.1 s later).
    work = a.post([P2P("recv", buf, 1)])
    sender = threading.Timer(0.1, lambda: b.post([P2P("send", torch.ones(4), 0)]).wait())
    sender.start()
    wait_work(work, abort, local=True)
    sender.join()
    assert torch.equal(buf, torch.ones(4))
    # A wait outside the pipeline ends at once.
    other = a.post([P2P("recv", torch.zeros(4), 1, tag=3)])
    with pytest.raises(StepAborted):
        wait_work(other, abort)
    # With a grace, a local wait whose peer never sends ends when the grace runs out.
    graced = AbortSignal(local_grace_s=0.2)
    graced.set("lost node(s) [5]", local=True)
    start = time.monotonic()
    with pytest.raises(StepAborted, match="did not finish its microbatches"):
        wait_work(a.post([P2P("recv", torch.zeros(4), 1, tag=4)]), graced, local=True)
    assert time.monotonic() - start < 5.0
    # A hard abort ends a local wait too.
    hard = AbortSignal()
    hard.set("lost node(s) [5]", local=True)
    threading.Timer(0.1, lambda: hard.set("lost node(s) [0]")).start()
    with pytest.raises(StepAborted, match=r"\[0\]"):
        wait_work(a.post([P2P("recv", torch.zeros(4), 1, tag=5)]), hard, local=True)


def test_kept_sums_of_a_layer_that_moves_travel_with_it(tmp_path: Path) -> None:
    """Node 0 keeps step 2's sums of every layer, then holds only [3, 6) in a 2-stage pipeline
    with node 1: its sums of [0, 3) go to node 1 over the new world group, and the step is the
    failure-free one."""
    reference = _pair(tmp_path / "ref", [None, None])
    _both(lambda r: reference[r].train(3))

    aborts = [AbortSignal(), AbortSignal()]
    trainers = _pair(tmp_path / "run", list(aborts))
    _both(lambda r: trainers[r].train(2))
    aborts[0].set("lost node(s) [1]", local=True)  # node 1's pipeline failed step 2; node 0's did not
    with pytest.raises(StepAborted):
        trainers[0].prepare_step()
    assert trainers[0].kept is not None and trainers[1].kept is None

    split = Plan(num_layers=6, microbatch_size=2, gpus_per_node=1, fault_tolerance=0, pipelines=(
        PipelinePlan(stages=(StagePlan(node=1, layers=(0, 3)), StagePlan(node=0, layers=(3, 6))), microbatches=4),
    ))
    replay = resolve_replay(split, [(0, 0, trainers[0].kept.report()), (1, 0, None)], step=2)
    assert replay.kept == [0, 1] and replay.moved == [[layer, 0, 0, 0, 1, 0] for layer in range(3)]
    store = dist.HashStore()
    _both(lambda r: trainers[r].start(plan=split, generation=2, store=store, abort=AbortSignal(), fetch=None, step=2,
                                      replay=replay))
    adopted = joined(trainers[1]._current).transaction.replay  # noqa: SLF001 - node 1 adopted node 0's sums of [0, 3)
    assert adopted is not None and {trainers[1].layer_of(n) for named in adopted.sums.values() for n in named} == {0, 1, 2}
    _both(lambda r: trainers[r].train(3))
    want = dict(reference[0].module.named_parameters())
    got = {**dict(trainers[1].module.named_parameters()), **dict(trainers[0].module.named_parameters())}
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert torch.equal(got[name], p), name


def test_every_worker_of_a_replayed_step_computes_every_peers_blocks() -> None:
    """Old pipelines A (microbatches 0-2: nodes 0, 1), B (3-5: nodes 2, 3, lost) and C (6-7:
    nodes 4, 5); the new plan's two pipelines recompute B's microbatches (3-4 and 5). Node 1
    adopts layer 2 of A's sums (node 0 no longer holds it) and layer 3 of C's (from node 5), so
    it sends A's and C's blocks besides its share; for every layer the holders' blocks partition
    the step's 8 microbatches."""
    new = Plan(num_layers=6, microbatch_size=2, gpus_per_node=1, fault_tolerance=1, pipelines=(
        PipelinePlan(stages=(StagePlan(node=0, layers=(0, 2)), StagePlan(node=1, layers=(2, 6))), microbatches=4),
        PipelinePlan(stages=(StagePlan(node=4, layers=(0, 4)), StagePlan(node=5, layers=(4, 6))), microbatches=4),
    ))
    reports = [(0, 0, PartialReport(step=5, microbatches=(0, 1, 2), layers=(0, 3), tp_rank=0)),
               (1, 0, PartialReport(step=5, microbatches=(0, 1, 2), layers=(3, 6), tp_rank=0)),
               (4, 0, PartialReport(step=5, microbatches=(6, 7), layers=(0, 3), tp_rank=0)),
               (5, 0, PartialReport(step=5, microbatches=(6, 7), layers=(3, 6), tp_rank=0))]
    replay = resolve_replay(new, reports, step=5)
    assert replay.missing == [3, 4, 5] and replay.moved == [[2, 0, 0, 0, 1, 0], [3, 0, 5, 0, 1, 0]]
    blocks = replay_blocks(replay, new)
    by_node = {w.node: blocks[w.rank] for w in assign_ranks(new)}
    a, c = [Block(0, 2), Block(2, 1)], [Block(6, 2)]
    assert by_node == {
        0: tuple(sorted([*a, Block(3, 1), Block(4, 1)])),
        1: tuple(sorted([*a, Block(3, 1), Block(4, 1), *c])),
        4: tuple(sorted([Block(5, 1), *c])),
        5: tuple(sorted([Block(5, 1), *c])),
    }
    for layer in range(6):
        holders = [st.node for pipe in new.pipelines for st in pipe.stages if st.first <= layer < st.last]
        distinct = sorted({b for node in holders for b in by_node[node]})
        assert [m for b in distinct for m in range(b.start, b.end)] == list(range(8)), layer
    with pytest.raises(ValueError, match="kept sets"):
        replay_blocks(ReplayRecord(step=5, total=8, set_runs=[[[0, 3]]], set_nodes=[]), new)
