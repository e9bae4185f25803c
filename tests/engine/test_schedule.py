"""The 1F1B schedule as data: order, memory bound, and freedom from deadlock by simulation."""

from __future__ import annotations

import pytest

from elastic.parallel.interleaved import chunk_table, interleaved, warmup_count
from elastic.parallel.schedule import (
    Action,
    Op,
    ScheduleError,
    one_f_one_b,
    simulate,
)
from templates.cost import pipeline_time
from tests.engine.schedules import peak_in_flight, pipeline_schedule

pytestmark = pytest.mark.timeout(60)

SHAPES = [(s, m) for s in range(1, 6) for m in range(1, 9)]


@pytest.mark.parametrize(("stages", "mbs"), SHAPES)
def test_every_stage_runs_each_microbatch_once_in_order(stages: int, mbs: int) -> None:
    for s in range(stages):
        actions = one_f_one_b(num_stages=stages, stage=s, microbatches=mbs)
        fwd = [a.mb for a in actions if a.op is Op.FORWARD]
        bwd = [a.mb for a in actions if a.op is Op.BACKWARD]
        assert fwd == list(range(mbs)) and bwd == list(range(mbs))
        # 1F1B bound: at most stages - s microbatches hold activations at once.
        assert peak_in_flight(actions) == min(stages - s, mbs)
        ops = {a.op for a in actions}
        assert (Op.RECV_ACT in ops) == (s > 0) and (Op.SEND_GRAD in ops) == (s > 0)
        assert (Op.SEND_ACT in ops) == (s < stages - 1) and (Op.RECV_GRAD in ops) == (s < stages - 1)


@pytest.mark.parametrize(("stages", "mbs"), SHAPES)
def test_pipelines_of_any_depth_run_to_completion(stages: int, mbs: int) -> None:
    order = simulate(pipeline_schedule(num_stages=stages, microbatches=mbs))
    assert len(order) == sum(len(a) for a in pipeline_schedule(num_stages=stages, microbatches=mbs))


def test_the_last_stage_alternates_forward_and_backward() -> None:
    actions = one_f_one_b(num_stages=3, stage=2, microbatches=3)
    assert [str(a) for a in actions] == [
        "recv_act(0)", "forward(0)", "backward(0)", "send_grad(0)",
        "recv_act(1)", "forward(1)", "backward(1)", "send_grad(1)",
        "recv_act(2)", "forward(2)", "backward(2)", "send_grad(2)",
    ]


def test_first_stage_warms_up_then_alternates() -> None:
    actions = one_f_one_b(num_stages=3, stage=0, microbatches=4)
    compute = [str(a) for a in actions if a.op in (Op.FORWARD, Op.BACKWARD)]
    assert compute == [
        "forward(0)", "forward(1)", "forward(2)", "backward(0)", "forward(3)", "backward(1)", "backward(2)", "backward(3)",
    ]


def test_simulator_detects_a_deadlock() -> None:
    # Stage 1 waits for a gradient it would only get after stage 0 received one from it.
    stage0 = [Action(Op.FORWARD, 0), Action(Op.RECV_GRAD, 0), Action(Op.SEND_ACT, 0), Action(Op.BACKWARD, 0)]
    stage1 = [Action(Op.RECV_ACT, 0), Action(Op.FORWARD, 0), Action(Op.BACKWARD, 0), Action(Op.SEND_GRAD, 0)]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([stage0, stage1])


def test_simulator_detects_out_of_order_transfers() -> None:
    good = pipeline_schedule(num_stages=2, microbatches=2)
    swapped = list(good[1])
    i, j = swapped.index(Action(Op.RECV_ACT, 0)), swapped.index(Action(Op.RECV_ACT, 1))
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ScheduleError):
        simulate([good[0], swapped])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="stage 3"):
        one_f_one_b(num_stages=3, stage=3, microbatches=1)
    with pytest.raises(ValueError, match="at least one microbatch"):
        one_f_one_b(num_stages=1, stage=0, microbatches=0)


INTERLEAVED = [(p, v, m) for p in range(2, 6) for v in (2, 3) for m in range(1, 3 * p + 2)]


@pytest.mark.parametrize(("stages", "chunks", "mbs"), INTERLEAVED)
def test_interleaved_runs_every_chunk_of_every_microbatch_once(stages: int, chunks: int, mbs: int) -> None:
    schedules = [interleaved(num_stages=stages, stage=s, microbatches=mbs, chunks=chunks) for s in range(stages)]
    simulate(schedules)  # no deadlock, every message where it is expected
    table = chunk_table(num_stages=stages, microbatches=mbs, chunks=chunks)
    for s, actions in enumerate(schedules):
        fwd = [(a.mb, a.chunk) for a in actions if a.op is Op.FORWARD]
        bwd = [(a.mb, a.chunk) for a in actions if a.op is Op.BACKWARD]
        assert fwd == table  # Megatron's table: groups of p microbatches, chunk by chunk
        assert bwd == [(mb, chunks - 1 - c) for mb, c in table]
        padded = -(-mbs // stages) * stages  # the schedule of m' = ceil(m / p) * p, thinned
        warm = warmup_count(num_stages=stages, stage=s, microbatches=padded, chunks=chunks)
        assert peak_in_flight(actions) <= min(warm + 1, padded * chunks)
        assert peak_in_flight(actions) <= (chunks - 1) * stages + 2 * (stages - 1) + 1  # Megatron's bound
        if padded > stages:
            assert warm == (stages - s - 1) * 2 + (chunks - 1) * stages


@pytest.mark.parametrize(("stages", "chunks", "mbs"), INTERLEAVED)
def test_the_planners_step_time_is_the_schedules(stages: int, chunks: int, mbs: int) -> None:
    """`templates.cost.pipeline_time` (what the planner predicts) equals the schedule played with
    stages of equal time, m a multiple of p or not (1F1B too)."""
    played = _makespan([interleaved(num_stages=stages, stage=s, microbatches=mbs, chunks=chunks)
                        for s in range(stages)], 1.0 / chunks)
    assert pipeline_time([2.0] * stages, mbs, chunks) == pytest.approx(played)
    plain = _makespan([one_f_one_b(num_stages=stages, stage=s, microbatches=mbs) for s in range(stages)], 1.0)
    assert pipeline_time([2.0] * stages, mbs) == pytest.approx(plain)


def test_interleaving_shrinks_the_bubble_in_simulated_time() -> None:
    """Played with unit-time computations (a chunk of 1/v the work), v = 2 finishes sooner than
    1F1B: the bubble (p - 1) / m of a step becomes (p - 1) / (v m)."""
    p, m = 4, 8
    plain = _makespan([one_f_one_b(num_stages=p, stage=s, microbatches=m) for s in range(p)], 1.0)
    two = _makespan([interleaved(num_stages=p, stage=s, microbatches=m, chunks=2) for s in range(p)], 0.5)
    assert plain == pytest.approx(2 * (m + p - 1))  # 1F1B: (m + p - 1) forward-backward slots
    assert two < plain
    assert two == pytest.approx(2 * (m + (p - 1) / 2), rel=0.15)


def _makespan(schedules: list[list[Action]], unit: float) -> float:
    """Finish time of the schedules when a forward or backward takes `unit` and transfers none."""
    clock = [0.0] * len(schedules)
    ready: dict[tuple[str, int, int, int], float] = {}
    n = len(schedules)
    for s, a in simulate(schedules):  # a valid global order: every dependency runs first
        if a.op is Op.SEND_ACT:
            dst = (s + 1) % n
            ready[("act", dst, a.chunk + (dst == 0), a.mb)] = clock[s]
        elif a.op is Op.SEND_GRAD:
            ready[("grad", (s - 1) % n, a.chunk - (s == 0), a.mb)] = clock[s]
        elif a.op is Op.RECV_ACT:
            clock[s] = max(clock[s], ready[("act", s, a.chunk, a.mb)])
        elif a.op is Op.RECV_GRAD:
            clock[s] = max(clock[s], ready[("grad", s, a.chunk, a.mb)])
        else:
            clock[s] += unit
    return max(clock)


def test_interleaved_with_one_chunk_is_1f1b() -> None:
    for s in range(3):
        assert interleaved(num_stages=3, stage=s, microbatches=5, chunks=1) == one_f_one_b(
            num_stages=3, stage=s, microbatches=5)


def test_interleaved_bad_arguments() -> None:
    with pytest.raises(ValueError, match="2 or more"):
        interleaved(num_stages=1, stage=0, microbatches=4, chunks=2)
    with pytest.raises(ValueError, match="at least one model chunk"):
        interleaved(num_stages=2, stage=0, microbatches=4, chunks=0)
