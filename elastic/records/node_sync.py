"""A node's workers' sync reports of a halted generation in one key, `sync/<g>/<node>/all` (issue 34).

One key a worker made a change cost the db O(workers) keys and bytes: 16,384 reports, 2.9 MB at
16,384 workers, rewritten every change. A node's workers report through its agent's relay, which
folds them into one record (elastic/roles/etcd_writes.py, a compare-and-swap like the recovery
records'); a worker without an agent folds its own in. Workers whose reports are equal but for
their local rank (a node's workers usually halt at the same step, with the same vote) share one
group, so a node's record is about one report's size.

Folding is idempotent and keyed by local rank: a worker's later report replaces its earlier one.
Readers (the leader) take both forms, this and a worker's own `SyncReport` at
`sync/<g>/<node>/<local_rank>` (`reports_of`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.coordinator.jsonrecord import RUNS, JsonRecord, parse_text
from elastic.records.generation import Vote
from elastic.records.partial import PartialReport
from elastic.records.sync import SyncReport

NODE_KEY = "all"
"""The last component of a node's folded key, `sync/<g>/<node>/all` and `holdings/<node>/all` (a
worker's own key ends in its local rank)."""


@dataclass(frozen=True, kw_only=True)
class SyncGroup:
    """The reports of the workers `local_ranks`, equal but for their local rank."""

    local_ranks: list[int] = field(metadata=RUNS)
    committed: int | None
    pending: int | None
    last_vote: Vote | None
    partial: PartialReport | None = None
    moments: list[tuple[int, int, int, int, int]] | None = None
    """SyncReport.moments (sharded optimizer): a node's workers of other tensor-parallel ranks have
    other shards, so with it each worker is a group of its own."""


@dataclass(frozen=True, kw_only=True)
class NodeSyncReports(JsonRecord):
    """Node `node`'s workers' sync reports of one generation, grouped."""

    node: int
    groups: list[SyncGroup]

    @classmethod
    def of(cls, reports: list[SyncReport]) -> NodeSyncReports:
        """`reports` (of one node; a local rank's last one counts) grouped."""
        if not reports:
            raise ValueError("a node's sync record needs a report")
        nodes = {r.node for r in reports}
        if len(nodes) != 1:
            raise ValueError(f"one node's sync record cannot hold reports of nodes {sorted(nodes)}")
        by_rank = {r.local_rank: r for r in reports}
        groups: dict[tuple[object, ...], list[int]] = {}
        for lr, r in sorted(by_rank.items()):
            moments = None if r.moments is None else tuple(map(tuple, r.moments))
            groups.setdefault((r.committed, r.pending, r.last_vote, r.partial, moments), []).append(lr)
        return cls(node=nodes.pop(), groups=[
            SyncGroup(local_ranks=lrs, committed=c, pending=p, last_vote=v, partial=part,  # type: ignore[arg-type]
                      moments=None if m is None else list(m))  # type: ignore[call-overload]
            for (c, p, v, part, m), lrs in groups.items()])

    def reports(self) -> list[SyncReport]:
        """Every worker's report, by local rank."""
        out = [SyncReport(committed=g.committed, pending=g.pending, last_vote=g.last_vote, node=self.node,
                          local_rank=lr, partial=g.partial, moments=g.moments)
               for g in self.groups for lr in g.local_ranks]
        return sorted(out, key=lambda r: r.local_rank)

    def fold(self, other: NodeSyncReports) -> NodeSyncReports:
        """Both as one: `other`'s report of a local rank replaces `self`'s."""
        return NodeSyncReports.of([*self.reports(), *other.reports()])


def reports_of(value: bytes | str) -> list[SyncReport]:
    """The reports a `sync/` value holds: a node's record, or one worker's own report. RecordError
    (a ValueError) when it is neither."""
    data = parse_text(value, "sync report")
    if isinstance(data, dict) and "groups" in data:
        return NodeSyncReports.from_parsed(data).reports()
    return [SyncReport.from_parsed(data)]  # parsed once
