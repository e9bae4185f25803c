"""A node's sync reports in one record (elastic/records/node_sync.py): grouped, it gives back every
worker's own report; folding is keyed by local rank, idempotent and order-free; a value of either
form reads as the reports it holds, and a malformed one is refused. A node's holdings fold the same
way (elastic/records/node_holdings.py)."""

from __future__ import annotations

import dataclasses
import random
import zlib

import pytest

from elastic.coordinator.jsonrecord import JsonRecord, RecordError
from elastic.records.generation import Vote
from elastic.records.node_holdings import NodeHoldings
from elastic.records.node_sync import NodeSyncReports, reports_of
from elastic.records.partial import PartialReport
from elastic.records.sync import SyncReport


def _report(rng: random.Random, node: int, lr: int) -> SyncReport:
    """Mostly the node's common report; now and then one that differs (a pending vote, kept sums,
    the moments of its shards under the sharded optimizer)."""
    report = _kind(rng, node, lr)
    if rng.random() < 0.3:
        report = dataclasses.replace(report, moments=[(2, lr % 2, 0, 512, 1024), (3, lr % 2, 512, 1024, 1024)])
    return report


def _kind(rng: random.Random, node: int, lr: int) -> SyncReport:
    kind = rng.random()
    vote = Vote(step=41, grad_norm=1.25, loss=3.5)
    if kind < 0.6:
        return SyncReport(committed=42, pending=None, last_vote=vote, node=node, local_rank=lr)
    if kind < 0.8:
        return SyncReport(committed=42, pending=42, last_vote=vote, node=node, local_rank=lr)
    partial = PartialReport(step=42, microbatches=(0, 1, 2), layers=(2, 4), tp_rank=lr % 2)
    return SyncReport(committed=42, pending=None, last_vote=vote, node=node, local_rank=lr, partial=partial)


@pytest.mark.parametrize("seed", range(6))
def test_a_node_record_gives_back_every_workers_report_whatever_the_folding_order(seed: int) -> None:
    rng = random.Random(seed)
    reports = [_report(rng, 5, lr) for lr in range(8)]
    whole = NodeSyncReports.of(reports)
    assert whole.reports() == reports
    assert NodeSyncReports.from_json(whole.to_json()) == whole and reports_of(whole.to_json()) == reports
    assert reports_of(whole.to_packed()) == reports == reports_of(whole.to_json().encode())  # as stored in etcd
    singles = [NodeSyncReports.of([r]) for r in rng.sample(reports, len(reports))]
    folded = singles[0]
    for s in singles[1:]:
        folded = folded.fold(s)
    assert folded == whole, "the folding order changes nothing"
    assert folded.fold(singles[3]) == whole and whole.fold(whole) == whole, "folding again changes nothing"
    assert len(whole.groups) == len({(r.committed, r.pending, r.last_vote, r.partial, repr(r.moments)) for r in reports})
    assert any(r.moments for r in reports) or seed not in (0, 1), "some seeds carry moments"


def test_equal_reports_share_one_group_of_about_one_reports_size() -> None:
    vote = Vote(step=811, grad_norm=1.2345678901, loss=2.345678901234)
    reports = [SyncReport(committed=812, pending=None, last_vote=vote, node=2047, local_rank=lr) for lr in range(8)]
    record = NodeSyncReports.of(reports)
    assert len(record.groups) == 1 and record.groups[0].local_ranks == list(range(8))
    assert len(record.to_json()) < 1.3 * len(reports[0].to_json())


def test_a_later_report_of_a_worker_replaces_its_earlier_one() -> None:
    old = SyncReport(committed=3, pending=3, last_vote=None, node=1, local_rank=0)
    new = SyncReport(committed=4, pending=None, last_vote=None, node=1, local_rank=0)
    other = SyncReport(committed=3, pending=3, last_vote=None, node=1, local_rank=1)
    assert NodeSyncReports.of([old, other]).fold(NodeSyncReports.of([new])).reports() == [new, other]


def test_reports_of_two_nodes_or_none_are_refused() -> None:
    a = SyncReport(committed=1, pending=None, last_vote=None, node=1, local_rank=0)
    with pytest.raises(ValueError, match=r"nodes \[1, 2\]"):
        NodeSyncReports.of([a, SyncReport(committed=1, pending=None, last_vote=None, node=2, local_rank=0)])
    with pytest.raises(ValueError, match="needs a report"):
        NodeSyncReports.of([])


@pytest.mark.parametrize(("value", "message"), [
    (b"{not json", r"^sync report: not valid JSON"),
    (b'{"groups": [{"local_ranks": [0]}], "node": 1, "v": 1}', r"^NodeSyncReports\.groups\[0\]: missing field 'committed'"),
    (b'{"groups": [], "node": "x", "v": 1}', r"^NodeSyncReports\.node: expected int"),
    (b'{"committed": 1}', r"^SyncReport: missing field"),
])
def test_a_malformed_value_is_refused_naming_the_field(value: bytes, message: str) -> None:
    with pytest.raises(RecordError, match=message):
        reports_of(value)


def test_a_nodes_holdings_fold_by_local_rank_and_refuse_another_nodes() -> None:
    a = NodeHoldings(node=2, held={0: [(0, 0), (1, 0)], 1: [(0, 1)]})
    later = NodeHoldings(node=2, held={1: [(0, 1), (2, 1)]})
    folded = a.fold(later)
    assert folded.held == {0: [(0, 0), (1, 0)], 1: [(0, 1), (2, 1)]}
    assert folded.fold(later) == folded and NodeHoldings.from_json(folded.to_json()) == folded
    with pytest.raises(ValueError, match="node 2's holdings cannot fold node 3's"):
        a.fold(NodeHoldings(node=3, held={}))


@pytest.mark.parametrize("seed", range(4))
def test_the_holdings_fast_read_is_the_checked_read(seed: int) -> None:
    """NodeHoldings.from_json's fast path reads what JsonRecord's checked decode reads, and leaves
    anything else to it (its errors name the field)."""
    rng = random.Random(seed)
    record = NodeHoldings(node=rng.randrange(2048), held={
        lr: sorted((rng.randrange(96), rng.randrange(8)) for _ in range(rng.randrange(4))) for lr in range(8)})
    text = record.to_json()
    assert NodeHoldings.from_json(text) == JsonRecord.from_json.__func__(NodeHoldings, text) == record  # type: ignore[attr-defined]
    packed = record.to_packed()  # as stored in etcd: zlib when that is shorter
    assert NodeHoldings.from_json(packed) == record and (packed[0] == 0x78) == (len(packed) < len(text))
    with pytest.raises(RecordError, match="NodeHoldings: a packed record is truncated"):
        NodeHoldings.from_json(zlib.compress(text.encode())[:-3])
    for bad, message in [(text.replace('"node": ', '"node": "x', 1).replace(', "v"', '", "v"', 1), r"node: expected int"),
                         ('{"held": {"0": [[1, 2.5]]}, "node": 1, "v": 1}', r"held\['0'\]\[0\]\[1\]: expected int"),
                         ('{"held": {}, "node": 1, "v": 2}', r"schema version 2 is newer"),
                         ('{"held": {}, "node": 1, "v": 1, "x": 0}', r"unknown field")]:
        with pytest.raises(RecordError, match=message):
            NodeHoldings.from_json(bad)
