"""The sharded optimizer's step moves the unsharded step's bytes (issue 55).

Four one-stage pipelines at f = 1: every layer has P = 4 holders and 2 optimizer slices of 2
owners each. Unsharded, the exchange's second phase all-gathers the reduced gradient: each
element reaches the P - 1 other holders. Sharded, it reaches only its slice's owners, and the
gather of updated parameters brings it to the other holders after the step (one gather here:
the end state's). The recording group counts the bytes of generation 1's step: the first phase
is the same, the second phase and the gather together send at most P/(P - 1) of the unsharded
second phase (an element whose exchange holder does not own it costs one copy more), where a
gather on top of the unchanged all-gather sent 5/3. The end state is the same, bit for bit,
parameters and moments.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from elastic.comm import Event
from elastic.comm.nccl_model import check
from elastic.engine.optim_shards import GATHER_TAG
from elastic.model.config import GPTConfig
from elastic.parallel.tied import TIED_TAG
from templates.optim_slices import plan_owners
from templates.plan import PipelinePlan, Plan, StagePlan, even_plan
from tests.comm.cluster import LAYERS, SHAPE, SHARED_KV_SHAPE, Case, Outcome, run_case, same_end_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

HOLDERS = 4


def _four_pipelines() -> Plan:
    return even_plan(num_layers=LAYERS, nodes=list(range(HOLDERS)), num_pipelines=HOLDERS, global_microbatches=8,
                     microbatch_size=1, fault_tolerance=1)


def _run(tmp_path: Path, sharded: bool, plan: Plan, *, shape: GPTConfig = SHAPE, sequence_parallel: bool = True,
         ) -> Outcome:
    assert {o.slices for o in plan_owners(plan).values()} == {2}
    job = Case(name=f"sharded{sharded:d}", plan1=plan, plan2=plan, shard_optimizer=sharded, shape=shape,
               sequence_parallel=sequence_parallel)
    out = run_case(job, tmp_path / job.name)
    assert not out.errors, out.errors
    report = check(out.logs)
    assert report.ok, report.describe()
    return out


def _sent(logs: dict[tuple[int, int], list[Event]], phase: str) -> int:
    """Bytes all workers sent in generation 1: the exchange's first or second phase (even or odd
    tags on the bucket communicators), or the parameter gather (world, GATHER_TAG and up)."""
    total = 0
    for log in logs.values():
        for event in log:
            if event.kind != "post" or event.comm is None or not event.comm.startswith("g1/"):
                continue
            world = event.comm.endswith("/world")
            total += sum(op.nbytes for op in event.ops if op.kind == "send" and _phase(op.tag, world) == phase)
    return total


def _phase(tag: int, world: bool) -> str | None:
    if world:
        return "gather" if tag >= GATHER_TAG else None
    return None if tag >= TIED_TAG else ("second" if tag % 2 else "first")


def test_the_sharded_step_sends_the_bytes_of_the_unsharded_one(tmp_path: Path) -> None:
    off, on = _run(tmp_path, False, _four_pipelines()), _run(tmp_path, True, _four_pipelines())
    assert _sent(off.logs, "gather") == 0 and _sent(on.logs, "gather") > 0
    assert _sent(on.logs, "first") == _sent(off.logs, "first") > 0
    second_off, second_on = _sent(off.logs, "second"), _sent(on.logs, "second")
    assert second_on < second_off / 2, (second_on, second_off)  # 1-2 owners to reach, not 3 holders
    # Generation 1 gathers twice: at step 0's start (a new generation takes its parameters as
    # behind) and for the end state; each moves the same bytes.
    gathers = _sent(on.logs, "gather")
    assert gathers % 2 == 0
    total_on = second_on + gathers // 2
    assert second_off * 0.95 <= total_on <= second_off * HOLDERS / (HOLDERS - 1), (total_on, second_off)
    same_end_state(off, on)


def test_tied_and_shared_heads_at_tp2_end_as_unsharded(tmp_path: Path) -> None:
    """Two pipelines of two stages cut at different layers, TP 2, a tied embedding and head,
    one key/value head shared by both ranks, with Qwen2's biases: the buckets of the tied
    matrix keep the all-gather, tensor-parallel rank 1 measures its norm in the exchange over
    the runs it counts (its shared head's rows not), and the end state is unsharded's."""
    pipe = [((0, 3), (3, LAYERS)), ((0, 2), (2, LAYERS))]
    plan = Plan(num_layers=LAYERS, microbatch_size=1, gpus_per_node=2, fault_tolerance=0, pipelines=tuple(
        PipelinePlan(stages=tuple(StagePlan(node=2 * p + s, layers=r) for s, r in enumerate(cuts)), microbatches=2)
        for p, cuts in enumerate(pipe)))
    shape = dataclasses.replace(SHARED_KV_SHAPE, tie_embeddings=True)
    off = _run(tmp_path, False, plan, shape=shape, sequence_parallel=False)
    on = _run(tmp_path, True, plan, shape=shape, sequence_parallel=False)
    same_end_state(off, on)
