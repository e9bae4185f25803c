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
        out = fold_all([other], self)
        assert out is not None
        return out


def fold_all(records: list[RecoveryTimings], into: RecoveryTimings | None = None) -> RecoveryTimings | None:
    """`records` folded into `into` (None: nothing to fold), in one pass: what folding them one by
    one gives (`fold`), in time linear in their ranks (a generation's summary folds 2,048 node
    records). ValueError when two hold some but not all of the same ranks."""
    kept = distinct(records if into is None else [into, *records])
    if len(kept) <= 1:
        return kept[0] if kept else None
    owner: dict[int, RecoveryTimings] = {}
    node_bytes: dict[int, int] = {}
    for r in kept:
        for rank in r.ranks:
            if (first := owner.setdefault(rank, r)) is not r:
                raise ValueError(f"recovery records overlap in part: ranks {first.ranks} and {r.ranks}")
        for n, b in r.node_bytes.items():
            node_bytes[n] = node_bytes.get(n, 0) + b
    parts = [r.reconfig for r in kept]
    return RecoveryTimings(
        ranks=sorted(owner),
        seen_at=max(r.seen_at for r in kept),
        reconfig=ReconfigTimings(transfer_s=max(p.transfer_s for p in parts), rebuild_s=max(p.rebuild_s for p in parts),
                                 bytes_fetched=sum(p.bytes_fetched for p in parts),
                                 bytes_collective=sum(p.bytes_collective for p in parts)),
        started_at=max(r.started_at for r in kept),
        first_commit_at=max(r.first_commit_at for r in kept),
        node_bytes=dict(sorted(node_bytes.items())),
    )


def summary_of(by_node: dict[int, RecoveryTimings]) -> RecoveryTimings | None:
    """A generation's records by node (a summary already written under `SUMMARY_NODE`) as its
    one summary: folded, with each node's bytes (None: no records). ValueError when two records
    hold some but not all of the same ranks."""
    kept = distinct(list(by_node.values()))
    out = fold_all(kept)
    if out is None:
        return None
    ids = {id(r) for r in kept}
    node_bytes: dict[int, int] = {}
    for node, record in by_node.items():
        if id(record) in ids:
            own = record.node_bytes if node == SUMMARY_NODE or record.node_bytes else {node: record.reconfig.bytes_fetched}
            for n, b in own.items():
                node_bytes[n] = node_bytes.get(n, 0) + b
    return dataclasses.replace(out, node_bytes={n: b for n, b in sorted(node_bytes.items()) if b})


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
