"""Which worker writes which shard: exactly one per (layer, tp_rank), from the lowest pipeline."""

from __future__ import annotations

import pytest

from elastic.engine.checkpoint.policy import checkpoint_writer_shards
from elastic.parallel.layout import ParallelLayout
from tests.engine.plans import hetero


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tp", [1, 2])
def test_every_shard_has_exactly_one_writer_in_the_lowest_pipeline(tp: int) -> None:
    plan = hetero(tp=tp)  # a 3-stage pipeline beside a 2-stage one, nodes out of order
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
        assert who[0].stage_plan.holds(layer)
    # pipeline 1 holds everything too but writes nothing
    assert checkpoint_writer_shards(ParallelLayout(plan=plan, generation=3, node=1, local_rank=0)) == []
