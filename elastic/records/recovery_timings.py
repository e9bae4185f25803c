"""Where a node's workers' reconfiguration into a generation spent its time: `ReconfigTimings`
(what `Trainer.start` measured) inside `RecoveryTimings`, one record a node at
`recoveries/<g>/<node>` (issue 34: a generation change keeps O(nodes) records, not O(workers)).

A node's record folds its workers' own: the slowest worker's times, the sum of their bytes, and
the ranks folded in. Every reader's breakdown takes only maxima and sums of these fields
(elastic/records/recoveries.py `breakdown_of`), so folding a node's workers first changes no
figure. Folding is idempotent: a record whose ranks are already in is not added again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from elastic.coordinator.jsonrecord import INLINE, RUNS, JsonRecord

SUMMARY_NODE = -1
"""The node under which a generation's summary stands among its node records (`summary_of`, the
metrics' mirror)."""


@dataclass(frozen=True, kw_only=True)
class ReconfigTimings:
    """Where the time of one worker's joining a generation went (what `Trainer.start` measured)."""

    transfer_s: float
    """Seconds spent getting the missing shards (over the generation's process group, then from
    their holders) and the kept gradient sums that move with a layer."""
    rebuild_s: float
    """Seconds spent building the process groups, the stage module, its optimizer state and its
    gradient buffers (the recovery breakdown's `rebuilding_s`, the slowest worker's)."""
    bytes_fetched: int
    """Bytes of fetched tensors (parameters and optimizer moments)."""
    bytes_collective: int = 0
    """The part of `bytes_fetched` that came over the generation's process group."""


@dataclass(frozen=True, kw_only=True)
class RecoveryTimings(JsonRecord):
    """The reconfiguration into a generation of the workers `ranks` (one node's, folded), at
    `recoveries/<g>/<node>`.

    Its JSON is one flat object (`reconfig`'s fields beside the others). Folded, every time is
    the slowest of its workers' and every byte count their sum."""

    VERSION = 3  # 2: ranks added (one record a node, not a worker); 3: ranks as runs, node_bytes

    ranks: list[int] = field(metadata=RUNS)
    """World ranks (of generation g) whose reconfiguration this record folds, ascending (written
    as runs)."""
    seen_at: float
    """Wall time the (last) worker learned of the generation."""
    reconfig: ReconfigTimings = field(metadata=INLINE)
    """What joining the generation cost (transfer, rebuild, bytes)."""
    started_at: float
    """Wall time `Trainer.start` returned (the last worker's)."""
    first_commit_at: float
    """Wall time of the first commit in the generation (the last worker's)."""
    node_bytes: dict[int, int] = field(default_factory=dict)
    """A generation's summary only: `bytes_fetched` of each node that fetched any (a node's own
    record leaves it empty: its bytes are `reconfig.bytes_fetched`)."""
    last_revision: int | None = None
    """A generation's summary only: the etcd revision of the last node record folded in (what
    `elastic events` orders the recovery by, as before the fold)."""

    def fold(self, other: RecoveryTimings) -> RecoveryTimings:
        """Both records as one: the later times, the larger phases, the summed bytes, the ranks
        of both. `self` unchanged when `other`'s ranks are already in it (folded before), `other`
        when it holds all of `self`'s (a summary)."""
        if set(other.ranks) <= set(self.ranks):
            return self
        if set(self.ranks) <= set(other.ranks):
            return other
        if set(other.ranks) & set(self.ranks):
            raise ValueError(f"recovery records overlap in part: ranks {self.ranks} and {other.ranks}")
        a, b = self.reconfig, other.reconfig
        return RecoveryTimings(
            ranks=sorted({*self.ranks, *other.ranks}),
            seen_at=max(self.seen_at, other.seen_at),
            reconfig=ReconfigTimings(transfer_s=max(a.transfer_s, b.transfer_s), rebuild_s=max(a.rebuild_s, b.rebuild_s),
                                     bytes_fetched=a.bytes_fetched + b.bytes_fetched,
                                     bytes_collective=a.bytes_collective + b.bytes_collective),
            started_at=max(self.started_at, other.started_at),
            first_commit_at=max(self.first_commit_at, other.first_commit_at),
            node_bytes=_added(self.node_bytes, other.node_bytes),
        )


def _added(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
    return {n: a.get(n, 0) + b.get(n, 0) for n in sorted({*a, *b})}


def fold_all(records: list[RecoveryTimings], into: RecoveryTimings | None = None) -> RecoveryTimings | None:
    """`records` folded into `into` (None: nothing to fold)."""
    out = into
    for r in records:
        out = r if out is None else out.fold(r)
    return out


def summary_of(by_node: dict[int, RecoveryTimings]) -> RecoveryTimings | None:
    """A generation's records by node (a summary already written under `SUMMARY_NODE`) as its
    one summary: folded, with each node's bytes (None: no records). ValueError when two records
    hold some but not all of the same ranks."""
    kept = {id(r) for r in distinct(list(by_node.values()))}
    node_bytes: dict[int, int] = {}
    for node, record in by_node.items():
        if id(record) in kept:
            node_bytes = _added(node_bytes, record.node_bytes if node == SUMMARY_NODE or record.node_bytes
                                else {node: record.reconfig.bytes_fetched})
    out = fold_all([r for r in by_node.values() if id(r) in kept])
    if out is None:
        return None
    return dataclasses.replace(out, node_bytes={n: b for n, b in node_bytes.items() if b})


def distinct(records: list[RecoveryTimings]) -> list[RecoveryTimings]:
    """`records` without those whose workers another record already holds (a node's record beside
    its generation's summary): the largest first, a record kept while it adds a rank."""
    seen: set[int] = set()
    out = []
    for r in sorted(records, key=lambda r: -len(r.ranks)):
        if not set(r.ranks) <= seen:
            out.append(r)
            seen.update(r.ranks)
    return out


def workers_reported(records: list[RecoveryTimings]) -> int:
    """How many workers' reconfigurations `records` (one a node, or a generation's summary) hold."""
    return len(set().union(*(r.ranks for r in records)))
