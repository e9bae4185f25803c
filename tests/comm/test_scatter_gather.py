"""Scatter/gather between stages (issue 53): with TP 2 and no sequence parallelism, each
tensor-parallel rank sends half of every stage-boundary activation and gradient, and the
receiving node all-gathers it. The recording group counts the pipeline bytes each rank sends:
half of what whole tensors take, and the job ends with the same shards, bit for bit, in 1F1B and
in the interleaved schedule (v = 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic.comm import Event
from elastic.comm.nccl_model import check
from templates.plan import PipelinePlan, Plan, StagePlan
from tests.comm.cluster import LAYERS, Case, Outcome, run_case

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _plan(chunks: int) -> Plan:
    if chunks == 1:
        stages = (StagePlan(node=0, layers=(0, 3)), StagePlan(node=1, layers=(3, LAYERS)))
    else:
        stages = (StagePlan(node=0, layers=(0, 2), chunks=((0, 2), (3, 5))),
                  StagePlan(node=1, layers=(2, 3), chunks=((2, 3), (5, LAYERS))))
    return Plan(num_layers=LAYERS, microbatch_size=1, gpus_per_node=2, fault_tolerance=0,
                pipelines=(PipelinePlan(stages=stages, microbatches=4),))


def _pipeline_bytes(logs: dict[tuple[int, int], list[Event]]) -> dict[tuple[int, int], int]:
    """Bytes each worker sent point to point on generation 1's world communicator (the stage
    boundaries: generation 1 moves no shard)."""
    return {w: sum(op.nbytes for e in log if e.comm == "g1/world" for op in e.ops if op.kind == "send")
            for w, log in logs.items()}


def _run(tmp_path: Path, chunks: int, scatter_gather: bool) -> Outcome:
    plan = _plan(chunks)
    case = Case(name=f"v{chunks}-sg{scatter_gather:d}", plan1=plan, plan2=plan, sequence_parallel=False,
                scatter_gather=scatter_gather)
    out = run_case(case, tmp_path / case.name)
    assert not out.errors, out.errors
    report = check(out.logs)
    assert report.ok, report.describe()
    return out


@pytest.mark.parametrize("chunks", [1, 2])
def test_scatter_gather_halves_the_pipeline_bytes_with_the_same_result(tmp_path: Path, chunks: int) -> None:
    whole, split = _run(tmp_path, chunks, False), _run(tmp_path, chunks, True)
    sent_whole, sent_split = _pipeline_bytes(whole.logs), _pipeline_bytes(split.logs)
    assert all(b > 0 for b in sent_whole.values()), sent_whole
    # Every rank sends exactly half: the boundary tensors are cut in 2 equal parts.
    assert {w: 2 * b for w, b in sent_split.items()} == sent_whole
    # The receiving node all-gathers what it received in its tensor-parallel group.
    gathers = sum(1 for log in split.logs.values() for e in log for op in e.ops
                  if op.kind == "all_gather" and e.comm is not None and not e.comm.endswith("/world"))
    assert gathers > sum(1 for log in whole.logs.values() for e in log for op in e.ops if op.kind == "all_gather")
    assert split.shards.keys() == whole.shards.keys()
    for worker, mine in whole.shards.items():
        for key, state in mine.items():
            for name, tensor in state.items():
                assert split.shards[worker][key][name].equal(tensor), f"{worker} {key} {name}"
