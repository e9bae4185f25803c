"""Pure units of the evaluation: its schedule, how pipelines share the batches, when it runs."""

from __future__ import annotations

import pytest

from elastic.engine.eval import eval_due, pipeline_share
from elastic.parallel.schedule import Op, forward_only, simulate

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
@pytest.mark.parametrize("microbatches", [1, 2, 7])
def test_forward_only_schedule_runs_every_microbatch_forward_once(stages: int, microbatches: int) -> None:
    schedules = [forward_only(num_stages=stages, stage=s, microbatches=microbatches) for s in range(stages)]
    order = simulate(schedules)  # no deadlock, every activation received in order
    for actions in schedules:
        assert [a.mb for a in actions if a.op is Op.FORWARD] == list(range(microbatches))
        assert not any(a.op in (Op.BACKWARD, Op.RECV_GRAD, Op.SEND_GRAD) for a in actions)
    assert sum(1 for _, a in order if a.op is Op.FORWARD) == stages * microbatches


@pytest.mark.parametrize("batches", [1, 3, 8, 11])
@pytest.mark.parametrize("pipelines", [1, 2, 3, 4])
def test_pipelines_share_the_batches_exactly_once(batches: int, pipelines: int) -> None:
    shares = [pipeline_share(p, pipelines, batches) for p in range(pipelines)]
    assert [k for share in shares for k in share] == list(range(batches))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    with pytest.raises(ValueError):
        pipeline_share(pipelines, pipelines, batches)


def test_evaluations_follow_every_n_steps_and_the_last() -> None:
    assert [c for c in range(0, 11) if eval_due(c, every=3, steps=10)] == [3, 6, 9, 10]
    assert [c for c in range(0, 7) if eval_due(c, every=3, steps=6)] == [3, 6]
    assert not any(eval_due(c, every=0, steps=10) for c in range(11))
