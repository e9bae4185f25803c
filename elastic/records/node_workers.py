"""A node's workers' registrations, one key a node: `workers/<node>/all` (issue 34).

A worker registers once it serves shards (`WorkerInfo`: its pid, transfer address, incarnation
and start stamps), on its node's lease. One key a worker was 16,304 keys at 16,384 workers, 2.1 MB
that the job keeps for its whole life, about 3 MB of etcd's db. The node's agent folds its
workers' registrations into one record (elastic/roles/etcd_writes.py, a compare-and-swap), a
worker without an agent folds its own in. The record is stored packed (`to_packed`): a node's
registrations differ in a few digits, and 8 of them pack to about a third.

A fold keeps, for each local rank, the registration of the later incarnation (a node that came
back on a key its old lease has not yet dropped replaces its workers one by one), and then only
the registrations of the node's latest incarnation.

Readers (`registrations`, `read_registrations`) take both forms: this, and a worker's own
`workers/<node>/<local_rank>` (a WorkerInfo).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.jsonrecord import JsonRecord, parse_text
from elastic.coordinator.keys import RunKeys
from elastic.records.node_sync import NODE_KEY
from elastic.records.workers import WorkerInfo


@dataclass(frozen=True, kw_only=True)
class NodeWorkers(JsonRecord):
    """Node `node`'s workers' registrations, by local rank, of its latest incarnation."""

    node: int
    workers: dict[int, WorkerInfo]

    def fold(self, other: NodeWorkers) -> NodeWorkers:
        """Both as one: of two registrations of a local rank the later incarnation's (`other`'s
        when equal), and only the latest incarnation's registrations."""
        if other.node != self.node:
            raise ValueError(f"node {self.node}'s registrations cannot fold node {other.node}'s")
        merged = dict(self.workers)
        for local_rank, info in other.workers.items():
            if local_rank not in merged or info.incarnation >= merged[local_rank].incarnation:
                merged[local_rank] = info
        latest = max((info.incarnation for info in merged.values()), default=0)
        return NodeWorkers(node=self.node, workers={lr: info for lr, info in sorted(merged.items())
                                                     if info.incarnation == latest})


def node_workers_key(rk: RunKeys, node: int) -> str:
    """`workers/<node>/all`."""
    return rk.job.key("node-workers", node)


def registration(rk: RunKeys, node: int, local_rank: int, info: WorkerInfo, lease: int | None
                 ) -> tuple[str, NodeWorkers, int | None]:
    """The fold (etcd_writes.Fold) that registers worker `local_rank` of `node` in its node's key."""
    return node_workers_key(rk, node), NodeWorkers(node=node, workers={local_rank: info}), lease


def registrations(rk: RunKeys, kvs: Iterable[tuple[str, bytes]]) -> dict[tuple[int, int], WorkerInfo]:
    """(node, local_rank) -> registration, from `(key, value)`s under `workers/` of either form
    (a key's node record and its workers' own keys: the later incarnation of a worker wins).
    RecordError for a malformed value, ValueError for a key of another form."""
    out: dict[tuple[int, int], WorkerInfo] = {}

    def take(node: int, local_rank: int, info: WorkerInfo) -> None:
        known = out.get((node, local_rank))
        if known is None or info.incarnation >= known.incarnation:
            out[(node, local_rank)] = info

    for key, value in kvs:
        node, tail = key[len(rk.workers):].split("/")
        if tail == NODE_KEY:
            record = NodeWorkers.from_json(value)
            if record.node != int(node):
                raise ValueError(f"{key} holds node {record.node}'s registrations")
            for local_rank, info in record.workers.items():
                take(record.node, local_rank, info)
        else:
            take(int(node), int(tail), WorkerInfo.from_json(value))
    return dict(sorted(out.items()))


def worker_infos(value: bytes) -> list[WorkerInfo]:
    """The registrations in one value under `workers/<node>/` of either form, without its key
    (a prefix mirror's parse, once). RecordError for a value of neither form."""
    data = parse_text(value, "registration")
    if isinstance(data, dict) and "workers" in data:
        return list(NodeWorkers.from_parsed(data).workers.values())
    return [WorkerInfo.from_parsed(data)]


def read_registrations(client: EtcdClient, rk: RunKeys, *, node: int | None = None,
                       revision: int | None = None) -> dict[tuple[int, int], WorkerInfo]:
    """`registrations` of the whole job, or of node `node`, now or at etcd revision `revision`."""
    prefix = rk.workers if node is None else rk.node_workers(node)
    return registrations(rk, ((meta.key.decode(), value)
                              for value, meta in client.get_prefix(prefix, revision=revision)))
