"""ParallelLayout: ranks, neighbours, holder groups and gradient buckets of hand-built plans."""

from __future__ import annotations

import pytest

from elastic.parallel.layout import ParallelLayout, assign_ranks
from elastic.parallel.plan_ranks import GradBucket, all_group_ranks
from templates.plan import PlanError
from tests.engine.plans import hetero, two_by_two

pytestmark = pytest.mark.timeout(30)


def layouts(plan):  # type: ignore[no-untyped-def]
    return [ParallelLayout.for_rank(plan, 0, r) for r in range(len(assign_ranks(plan)))]


def test_ranks_are_dealt_pipeline_stage_tp_and_agree_from_every_worker() -> None:
    plan = hetero(tp=2)
    all_layouts = layouts(plan)
    assert [ly.rank for ly in all_layouts] == list(range(10))
    # rank -> (node, pipeline, stage, tp): pipeline 0 is nodes 4, 0, 2; pipeline 1 is nodes 1, 3.
    expected = [(4, 0, 0), (0, 0, 1), (2, 0, 2), (1, 1, 0), (3, 1, 1)]
    for r, ly in enumerate(all_layouts):
        node, p, s = expected[r // 2]
        assert (ly.node, ly.pipeline, ly.stage, ly.tp_rank) == (node, p, s, r % 2)
        assert ly.workers == all_layouts[0].workers
        assert ly.world_size == 10


def test_neighbours_share_the_tp_rank_and_stay_in_the_pipeline() -> None:
    by_rank = layouts(hetero(tp=2))
    r3 = by_rank[3]  # pipeline 0, stage 1, tp 1
    assert (r3.prev_rank, r3.next_rank) == (1, 5)
    assert r3.tp_ranks == (2, 3)
    assert by_rank[0].prev_rank is None and by_rank[5].next_rank is None
    assert (by_rank[6].prev_rank, by_rank[6].next_rank) == (None, 8)
    assert by_rank[9].prev_rank == 7 and by_rank[9].is_last_stage


def test_holders_and_buckets_follow_the_layer_splits() -> None:
    by_rank = layouts(hetero(tp=1))
    # Pipeline 0 splits [0,2) [2,4) [4,6) (ranks 0,1,2); pipeline 1 splits [0,3) [3,6) (ranks 3,4).
    assert by_rank[0].holders(0) == (0, 3)
    assert by_rank[0].buckets == (GradBucket(layers=(0, 1), ranks=(0, 3)),)
    assert by_rank[1].buckets == (
        GradBucket(layers=(2,), ranks=(1, 3)),
        GradBucket(layers=(3,), ranks=(1, 4)),
    )
    assert by_rank[3].buckets == (
        GradBucket(layers=(0, 1), ranks=(0, 3)),
        GradBucket(layers=(2,), ranks=(1, 3)),
    )
    assert by_rank[4].buckets == (
        GradBucket(layers=(3,), ranks=(1, 4)),
        GradBucket(layers=(4, 5), ranks=(2, 4)),
    )
    # One holder per pipeline for every layer, and exactly one of them counts it in the norm.
    for layer in range(6):
        counting = [
            ly.rank
            for ly in by_rank
            if ly.stage_plan.holds(layer) and ly.counts_layer_for_norm(layer)
        ]
        assert len(counting) == 1


def test_tp_ranks_get_disjoint_bucket_groups() -> None:
    ly = ParallelLayout.for_rank(hetero(tp=2), 0, 1)  # pipeline 0 stage 0 tp 1
    assert ly.buckets == (GradBucket(layers=(0, 1), ranks=(1, 7)),)
    assert ly.holders(0, tp_rank=0) == (0, 6)


def test_group_order_is_identical_everywhere_and_complete() -> None:
    all_layouts = layouts(hetero(tp=2))
    groups = all_group_ranks(all_layouts[0].plan)
    assert all(all_group_ranks(ly.plan) == groups for ly in all_layouts)
    assert len(set(groups)) == len(groups)
    for ly in all_layouts:
        assert ly.tp_ranks in groups
        assert all(b.ranks in groups for b in ly.buckets)


def test_two_identical_pipelines_make_one_bucket_per_stage() -> None:
    ly = ParallelLayout.for_rank(two_by_two(), 0, 2)  # pipeline 1 stage 0
    assert ly.buckets == (GradBucket(layers=(0, 1, 2), ranks=(0, 2)),)
    assert ly.microbatch_offset == 4 and ly.num_microbatches == 4


def test_bad_positions_are_refused() -> None:
    with pytest.raises(PlanError, match="node 9"):
        ParallelLayout(plan=two_by_two(), generation=0, node=9, local_rank=0)
    with pytest.raises(ValueError, match="local rank 1"):
        ParallelLayout(plan=two_by_two(), generation=0, node=0, local_rank=1)
    with pytest.raises(PlanError, match="rank 4"):
        ParallelLayout.for_rank(two_by_two(), 0, 4)
