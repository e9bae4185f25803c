"""Partial replay's pure part: which kept microbatches the leader accepts, and how the missing
ones are spread over the new plan (elastic/records/partial.py)."""

from __future__ import annotations

import pytest

from elastic.records.partial import (
    FINISH_FROM,
    PartialReport,
    ReplayRecord,
    from_runs,
    resolve_replay,
    split_microbatches,
    to_runs,
    worth_finishing,
)
from templates.plan import PipelinePlan, Plan, StagePlan

pytestmark = pytest.mark.timeout(30)


def plan(*pipes: tuple[tuple[tuple[int, int, int], ...], int], tp: int = 1) -> Plan:
    """Pipelines of ((node, first, last), ...) stages with their microbatch counts; 6 layers."""
    return Plan(
        num_layers=6, microbatch_size=2, gpus_per_node=tp, fault_tolerance=1,
        pipelines=tuple(PipelinePlan(stages=tuple(StagePlan(node=n, layers=(a, b)) for n, a, b in stages),
                                     microbatches=mbs) for stages, mbs in pipes),
    )


OLD = plan((((0, 0, 3), (1, 3, 6)), 4), (((2, 0, 3), (3, 3, 6)), 4))
"""2 pipelines x 2 stages, 8 microbatches: pipeline 0 takes 0-3, pipeline 1 takes 4-7."""


def kept(node: int, layers: tuple[int, int], mbs: tuple[int, ...], step: int = 5, tp_rank: int = 0) -> tuple[int, int, PartialReport]:
    return node, tp_rank, PartialReport(step=step, microbatches=mbs, layers=layers, tp_rank=tp_rank)


def test_split_follows_each_pipelines_share_and_covers_every_microbatch_once() -> None:
    new = plan((((0, 0, 3), (1, 3, 6)), 5), (((3, 0, 6),), 3))
    assert split_microbatches(new, [4, 5, 6, 7]) == [(4, 5, 6), (7,)]
    assert split_microbatches(new, list(range(8))) == [(0, 1, 2, 3, 4), (5, 6, 7)]
    assert split_microbatches(new, [6]) == [(6,), ()]
    three = plan(((((0, 0, 6),), 3)), (((1, 0, 6),), 3), (((2, 0, 6),), 2))
    for missing in ([], [1], [0, 5], [2, 3, 4, 7], list(range(8))):
        parts = split_microbatches(three, missing)
        assert [m for part in parts for m in part] == missing  # contiguous runs, in order, each once
        assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1 + (len(missing) > 4)


def test_an_intact_pipeline_whose_nodes_keep_their_layers_is_kept() -> None:
    new = plan((((0, 0, 3), (1, 3, 6)), 5), (((3, 0, 6),), 3))  # node 2 lost
    reports = [kept(0, (0, 3), (0, 1, 2, 3)), kept(1, (3, 6), (0, 1, 2, 3)), (3, 0, None)]
    record = resolve_replay(new, reports, step=5)
    assert record.kept == [0, 1, 2, 3] and record.keepers == [[0, 0], [1, 0]] and not record.recomputed
    assert record.missing == [4, 5, 6, 7] and record.replayed_fraction == 0.5
    assert record.is_keeper(1, 0) and not record.is_keeper(3, 0)
    assert ReplayRecord.from_dict(record.to_dict()) == record


def test_a_keeper_that_now_holds_more_layers_still_keeps() -> None:
    new = plan((((0, 0, 6),), 4), (((1, 0, 6),), 4))  # both survivors now hold the whole model
    record = resolve_replay(new, [kept(0, (0, 3), (0, 1, 2, 3)), kept(1, (3, 6), (0, 1, 2, 3))], step=5)
    assert record.kept == [0, 1, 2, 3]


def test_incomplete_stale_or_moved_sums_are_recomputed() -> None:
    new = plan((((0, 0, 3), (1, 3, 6)), 5), (((3, 0, 6),), 3))
    # The broken pipeline's survivor (node 3) finished its stage, but node 2's layers are gone.
    only_half = resolve_replay(new, [kept(3, (3, 6), (4, 5, 6, 7))], step=5)
    assert only_half.kept == [] and only_half.replayed_fraction == 1.0
    # Sums of another step say nothing of this one.
    stale = resolve_replay(new, [kept(0, (0, 3), (0, 1, 2, 3), step=4), kept(1, (3, 6), (0, 1, 2, 3), step=4)], step=5)
    assert stale.kept == []
    # A keeper missing from the new plan (here: node 1 left out) makes its set recomputed.
    without_1 = plan((((0, 0, 3), (3, 3, 6)), 5), (((4, 0, 6),), 3))
    record = resolve_replay(without_1, [kept(0, (0, 3), (0, 1, 2, 3)), kept(1, (3, 6), (0, 1, 2, 3))], step=5)
    assert record.kept == [] and len(record.recomputed) == 1 and "node(s) [1]" in record.recomputed[0]


def test_sums_of_a_layer_that_moves_go_to_its_new_holder() -> None:
    # Node 0 kept [0, 3) and now holds [3, 6); node 1 kept [3, 6) and now holds [0, 2); node 3 holds all.
    moved = plan((((1, 0, 2), (0, 2, 6)), 5), (((3, 0, 6),), 3))
    record = resolve_replay(moved, [kept(0, (0, 3), (0, 1, 2, 3)), kept(1, (3, 6), (0, 1, 2, 3))], step=5)
    assert record.kept == [0, 1, 2, 3] and record.keepers == [[0, 0], [1, 0]] and not record.recomputed
    # [layer, tp, from node, from rank, to node, to rank]: each layer's sums to the first pipeline's holder.
    assert record.moved == [[0, 0, 0, 0, 1, 0], [1, 0, 0, 0, 1, 0], [3, 0, 1, 0, 0, 0], [4, 0, 1, 0, 0, 0],
                            [5, 0, 1, 0, 0, 0]]
    assert ReplayRecord.from_dict(record.to_dict()) == record


def test_tensor_parallel_keepers_must_cover_every_rank() -> None:
    new = plan((((0, 0, 3), (1, 3, 6)), 5), (((3, 0, 6),), 3), tp=2)
    all_ranks = [kept(n, layers, (0, 1, 2, 3), tp_rank=t) for n, layers in ((0, (0, 3)), (1, (3, 6))) for t in (0, 1)]
    assert resolve_replay(new, all_ranks, step=5).kept == [0, 1, 2, 3]
    assert resolve_replay(new, all_ranks[:-1], step=5).kept == []


def test_pipelines_finish_a_step_only_once_it_is_far_enough_along() -> None:
    assert not worth_finishing(0.1, 24.0) and not worth_finishing(FINISH_FROM * 24.0 - 0.01, 24.0)
    assert worth_finishing(FINISH_FROM * 24.0, 24.0) and worth_finishing(30.0, 24.0)
    assert worth_finishing(0.0, 0.0)  # no step time known yet: finish


def test_the_record_grows_with_kept_sets_not_workers_or_microbatches() -> None:
    """The replay record fans out to every worker: its JSON is the same for 1 and 8 workers a
    node and for 8 and 800 microbatches a pipeline (runs, nodes), while its per-worker view
    (`keepers`, `kept_sets`, `kept`) equals the reports that were accepted."""

    def record(tp: int, per_pipeline: int) -> tuple[ReplayRecord, list[tuple[int, int, PartialReport]]]:
        pipes = [(((2 * p, 0, 3), (2 * p + 1, 3, 6)), per_pipeline) for p in range(8)]
        new = plan((((16, 0, 3), (17, 3, 6)), per_pipeline), *pipes[1:], tp=tp)  # pipeline 0's nodes replaced
        reports = []
        for p in range(1, 8):
            mbs = tuple(range(p * per_pipeline, (p + 1) * per_pipeline))
            for node, first, last in pipes[p][0]:
                reports += [kept(node, (first, last), mbs, tp_rank=t) for t in range(tp)]
        return resolve_replay(new, reports, step=5), reports

    (small, _), (wide, reports) = record(1, 8), record(8, 8)
    assert len(wide.to_json().replace('"tp": 8', '"tp": 1')) == len(small.to_json())
    assert len(record(1, 800)[0].to_json()) < len(small.to_json()) + 60  # longer numbers, no more of them
    assert wide.keepers == sorted([node, t] for node, t, _ in reports)
    by_worker = {(node, t): list(r.microbatches) for node, t, r in reports}
    assert wide.kept_sets == [by_worker[(node, t)] for node, t in wide.keepers]
    assert wide.kept == list(range(8, 64)) and wide.missing == list(range(8))
    assert ReplayRecord.from_json(wide.to_json()) == wide


def test_runs_round_trip() -> None:
    for values in ([], [3], [0, 1, 2], [0, 2, 3, 7, 8, 9, 12]):
        assert from_runs(to_runs(values)) == values
    assert to_runs([0, 2, 3, 7, 8, 9, 12]) == [[0, 1], [2, 4], [7, 10], [12, 13]]
