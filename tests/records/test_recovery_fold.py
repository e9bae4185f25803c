"""Folding a node's workers' recovery records (elastic/records/recovery_timings.py): the breakdown of
the folded records (one a node) equals the breakdown of the workers' own records, whatever the
order of folding; a record folded twice counts once; records that overlap in part are refused; a
superseded generation's summary of its node records reads as they do."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from elastic.parallel.layout import WorkerCoord, assign_ranks
from elastic.records.generation import GenerationRecord
from elastic.records.recoveries import breakdown_of
from elastic.records.recovery_timings import (
    SUMMARY_NODE,
    ReconfigTimings,
    RecoveryTimings,
    fold_all,
    summary_of,
    workers_reported,
)
from templates.plan import even_plan

T0 = 1_790_000_000.0


def _worker(rank: int, rng: random.Random) -> RecoveryTimings:
    return RecoveryTimings(
        ranks=[rank], seen_at=T0 + rng.uniform(0, 0.2),
        reconfig=ReconfigTimings(transfer_s=rng.uniform(0, 2), rebuild_s=rng.uniform(0, 1),
                                 bytes_fetched=rng.randrange(10**9), bytes_collective=rng.randrange(10**6)),
        started_at=T0 + rng.uniform(1, 3), first_commit_at=T0 + rng.uniform(3, 5))


def _generation(nodes: list[int], *, gpus: int, lost: int, rng: random.Random
                ) -> tuple[GenerationRecord, tuple[WorkerCoord, ...], list[RecoveryTimings]]:
    """A generation of 2 pipelines over `nodes` after losing `lost`, its ranks' coordinates, and
    each worker's own record."""
    plan = even_plan(num_layers=2 * len(nodes), nodes=nodes, num_pipelines=2, global_microbatches=2 * gpus,
                     microbatch_size=1, gpus_per_node=gpus)
    rec = GenerationRecord(plan=plan, resume_step=5, incarnations=dict.fromkeys(nodes, 0), lost=[lost],
                           detected_at=T0 - 1, synced_at=T0 - 0.8, published_at=T0 - 0.5)
    coords = assign_ranks(plan)
    return rec, coords, [_worker(rank, rng) for rank in range(len(coords))]


@pytest.mark.parametrize("seed", range(5))
def test_the_breakdown_of_node_records_is_that_of_the_workers(seed: int) -> None:
    rng = random.Random(seed)
    rec, coords, workers = _generation([0, 1, 3, 4, 6, 7], gpus=4, lost=2, rng=rng)
    nodes = rec.plan.nodes
    by_node: dict[int, list[RecoveryTimings]] = {}
    for w in rng.sample(workers, len(workers)):  # folded in any order
        by_node.setdefault(coords[w.ranks[0]].node, []).append(w)
    folded = [fold_all(ws) for ws in by_node.values()]
    assert all(f is not None for f in folded)
    node_records = [f for f in folded if f is not None]
    assert len(node_records) == len(nodes) and workers_reported(node_records) == len(workers) == workers_reported(workers)
    carried = [("kill-node2-step5", T0 - 1.3)]
    assert breakdown_of(2, rec, node_records, carried) == breakdown_of(2, rec, workers, carried)
    assert sorted(r for f in node_records for r in f.ranks) == list(range(len(coords)))


def test_folding_a_record_again_counts_it_once() -> None:
    rng = random.Random(7)
    a, b = _worker(4, rng), _worker(5, rng)
    both = a.fold(b)
    assert both.ranks == [4, 5] and both.fold(a) == both and both.fold(both) == both
    assert both.reconfig.bytes_fetched == a.reconfig.bytes_fetched + b.reconfig.bytes_fetched
    assert fold_all([a, b, a, b]) == both and fold_all([]) is None


def test_records_that_overlap_in_part_are_refused() -> None:
    rng = random.Random(8)
    ab = _worker(1, rng).fold(_worker(2, rng))
    bc = _worker(2, rng).fold(_worker(3, rng))
    with pytest.raises(ValueError, match=r"overlap in part: ranks \[1, 2\] and \[2, 3\]"):
        ab.fold(bc)


@pytest.mark.parametrize("seed", range(3))
def test_a_generations_summary_reads_as_its_node_records(seed: int) -> None:
    """The leader folds a superseded generation's node records into one: the breakdown, the
    workers counted and each node's bytes are those of the workers' own records, and a node
    record read beside the summary (a watch between the two) is counted once."""
    rng = random.Random(100 + seed)
    rec, coords, workers = _generation([0, 2, 5, 9], gpus=2, lost=1, rng=rng)
    nodes = rec.plan.nodes
    if seed == 0:  # a node that fetched nothing is left out of node_bytes
        workers = [replace(w, reconfig=replace(w.reconfig, bytes_fetched=0)) if coords[w.ranks[0]].node == 5 else w
                   for w in workers]
    by_node: dict[int, RecoveryTimings] = {}
    for w in workers:
        node = coords[w.ranks[0]].node
        by_node[node] = w if node not in by_node else by_node[node].fold(w)
    summary = summary_of(by_node)
    assert summary is not None and summary.ranks == list(range(len(coords)))
    expected_bytes = {n: sum(w.reconfig.bytes_fetched for w in workers if coords[w.ranks[0]].node == n) for n in nodes}
    assert summary.node_bytes == {n: b for n, b in expected_bytes.items() if b}
    carried = [("kill-node1-step3", T0 - 1.2)]
    reference = breakdown_of(2, rec, workers, carried)
    assert breakdown_of(2, rec, [summary], carried) == reference
    beside = [summary, by_node[2], by_node[9]]
    assert breakdown_of(2, rec, beside, carried) == reference and workers_reported(beside) == len(workers)
    # folding again, with the summary among the records (a late node record folded in later)
    late = {SUMMARY_NODE: summary_of({n: r for n, r in by_node.items() if n != 9}), 9: by_node[9]}
    again = summary_of(late)  # type: ignore[arg-type]
    assert again == summary
    assert summary_of({SUMMARY_NODE: summary, 2: by_node[2]}) == summary


def test_a_summary_that_overlaps_a_node_record_in_part_is_refused() -> None:
    rng = random.Random(9)
    a, b = _worker(1, rng), _worker(2, rng)
    with pytest.raises(ValueError, match="overlap in part"):
        summary_of({SUMMARY_NODE: a.fold(b), 3: b.fold(_worker(3, rng))})
