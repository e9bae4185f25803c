"""The shards a node's workers hold, one key a node: `holdings/<node>/all` (issue 34).

A worker writes what it holds when it halts a generation holding other shards than it last wrote
(elastic/roles/worker_feeds.py `write_sync`), on its node's lease. One key a worker made the
holder map 16,304 keys at 16,384 workers, which the leader reads at every change and, with the
collective shard path, every worker joining a generation reads too. The node's agent folds its
workers' holdings into one record (elastic/roles/etcd_writes.py, a compare-and-swap), a worker
without an agent folds its own in; a worker's later holdings replace its earlier ones.

Readers (elastic/roles/holders.py `read_holdings`) take both forms: this, and a worker's own
`holdings/<node>/<local_rank>` (a JSON array of [layer, tp_rank]).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Self

from elastic.coordinator.jsonrecord import JsonRecord, unpack_text
from elastic.coordinator.keys import RunKeys


@dataclass(frozen=True, kw_only=True)
class NodeHoldings(JsonRecord):
    """Node `node`'s workers' shards, by local rank: [layer, tp_rank] pairs, sorted."""

    node: int
    held: dict[int, list[tuple[int, int]]]

    @classmethod
    def from_json(cls, text: str | bytes) -> Self:
        """As JsonRecord's, on a fast path: the holder map reads one a node at every change (the
        checked decode takes 0.23 s for 2,048 nodes of 8 workers, this 0.02 s); anything off it
        is read by the checked decode, whose error names the field."""
        try:
            data = json.loads(unpack_text(text))
            if isinstance(data, dict) and data.keys() == {"v", "node", "held"} and data["v"] == cls.VERSION \
                    and type(data["node"]) is int and isinstance(data["held"], dict):
                held = {int(lr): [(a, b) for a, b in pairs] for lr, pairs in data["held"].items()}
                if all(type(a) is int and type(b) is int for pairs in held.values() for a, b in pairs):
                    return cls(node=data["node"], held=held)
        except (ValueError, TypeError):  # RecordError too: a corrupt packed value is left to the checked decode
            pass
        return super().from_json(text)

    def fold(self, other: NodeHoldings) -> NodeHoldings:
        """Both as one: `other`'s entry of a local rank replaces `self`'s."""
        if other.node != self.node:
            raise ValueError(f"node {self.node}'s holdings cannot fold node {other.node}'s")
        return NodeHoldings(node=self.node, held=dict(sorted({**self.held, **other.held}.items())))


def node_holdings_key(rk: RunKeys, node: int) -> str:
    """`holdings/<node>/all`."""
    return rk.job.key("node-holdings", node)
