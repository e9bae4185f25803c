"""Which worker writes which shard: exactly one per (layer, tp_rank), from the lowest pipeline."""

from __future__ import annotations

import pytest

from elastic.parallel.layout import ParallelLayout
from elastic.runtime.checkpoint import checkpoint_writer_shards
from templates.plan import PipelinePlan, Plan, StagePlan


def hetero(tp: int) -> Plan:
    """A 3-stage pipeline beside a 2-stage one with other layer splits; nodes out of order."""
    return Plan(
        num_layers=6,
        microbatch_size=1,
        gpus_per_node=tp,
        fault_tolerance=1,
        pipelines=(
            PipelinePlan(
                stages=(
                    StagePlan(node=4, layers=(0, 2)),
                    StagePlan(node=0, layers=(2, 4)),
                    StagePlan(node=2, layers=(4, 6)),
                ),
                microbatches=3,
            ),
            PipelinePlan(
                stages=(StagePlan(node=1, layers=(0, 3)), StagePlan(node=3, layers=(3, 6))),
                microbatches=2,
            ),
        ),
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tp", [1, 2])
def test_every_shard_has_exactly_one_writer_in_the_lowest_pipeline(tp: int) -> None:
    plan = hetero(tp)
    writers: dict[tuple[int, int], list[ParallelLayout]] = {}
    for node in (0, 1, 2, 3, 4):
        for t in range(tp):
            layout = ParallelLayout(plan=plan, generation=3, node=node, local_rank=t)
            for key in checkpoint_writer_shards(layout):
                writers.setdefault(key, []).append(layout)
    assert sorted(writers) == [(layer, t) for layer in range(6) for t in range(tp)]
    for (layer, t), who in writers.items():
        assert len(who) == 1, (layer, t)
        assert who[0].pipeline == 0 and who[0].tp_rank == t
        assert who[0].layers[0] <= layer < who[0].layers[1]
    # pipeline 1 holds everything too but writes nothing
    assert checkpoint_writer_shards(ParallelLayout(plan=plan, generation=3, node=1, local_rank=0)) == []
