"""The holder map of a generation change: which live worker holds which shards, read from etcd.

Every worker publishes the shards it holds, folded into its node's `holdings/<node>/all`
(elastic/records/node_holdings.py), when it halts a generation holding other shards than it last
wrote (most workers hold the same from change to change: no write then), in the transaction of
its sync report (elastic/roles/worker_feeds.py `write_sync`), and its shard server's address
in its registration, folded into `workers/<node>/all` (elastic/records/node_workers.py), both on its node's lease (a lost node's keys go with its
lease). The leader publishes generation g only after every live worker of g-1 has halted and
reported, so when g is read these keys say what each live worker holds after its last
generation: what it serves until it has joined g (and the shards it drops then stay served until
its next switch). A worker that never halted (a spare taking its first stage) has no entry: it
holds nothing. The leader reads the same `holdings/` keys, with the sync reports, to decide
whether some shard has no live holder. Two prefix reads per generation change, never per step,
and no write of their own: a change costs each node one transaction for the reports and
holdings of all its workers.

The collective shard path does not read it: the leader plans that path's moves from the
holdings it read once every report was in, into the generation record
(elastic/parallel/shard_moves.py), so no worker reads every node's keys at a change (1.1 MB at
2,048 nodes, read by each of 16,384 workers before). A worker reads the map only when it must
fetch over gRPC (`HolderMap.by_address`: a shard held only outside the generation, one that
arrived damaged, or the job's gRPC shard path), at the etcd revision at which g was published,
not at "now", so that it sees the holders the leader planned with. When etcd has compacted that
revision away (10 s of history by default: a very slow reconfiguration), the map is read as it
is now. `holder_map_reader` reads it on first use, once.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.keys import RunKeys
from elastic.records.node_holdings import NodeHoldings
from elastic.records.node_sync import NODE_KEY
from elastic.records.node_workers import read_registrations
from elastic.transfer.shards import ShardKey


@dataclass(frozen=True, kw_only=True)
class Holder:
    """One live worker's entry in the holder map."""

    node: int
    local_rank: int
    transfer_address: str | None
    """host:port of its shard server (its `workers/` record); None when that record is gone."""
    shards: tuple[ShardKey, ...]
    """The shards it holds (its `holdings/` key)."""


@dataclass(frozen=True, kw_only=True)
class HolderMap:
    """What every live worker holds, as etcd knows it."""

    holders: tuple[Holder, ...]
    """One entry per `holdings/` key, by (node, local_rank)."""

    @classmethod
    def read(cls, client: EtcdClient, rk: RunKeys, *, revision: int | None = None) -> HolderMap:
        """`holdings/` joined with `workers/` on (node, local_rank): two prefix reads, at `revision`
        (module doc) or, when None or compacted away, at the current revision."""
        if revision is not None:
            try:
                return cls._read(client, rk, revision)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.OUT_OF_RANGE:
                    raise
        return cls._read(client, rk, None)

    @classmethod
    def _read(cls, client: EtcdClient, rk: RunKeys, revision: int | None) -> HolderMap:
        addresses = {worker: info.transfer_address
                     for worker, info in read_registrations(client, rk, revision=revision).items()}
        holders = [
            Holder(node=node, local_rank=local_rank, shards=shards, transfer_address=addresses.get((node, local_rank)))
            for (node, local_rank), shards in read_holdings(client, rk, revision=revision).items()
        ]
        return cls(holders=tuple(sorted(holders, key=lambda h: (h.node, h.local_rank))))

    def by_address(self, *, exclude: str = "") -> dict[str, list[ShardKey]]:
        """Shard-server address -> the shards it serves (`fetch_shards`' holders): every worker
        that holds a shard and is registered, but the one serving at `exclude` (the caller)."""
        return {
            h.transfer_address: list(h.shards)
            for h in self.holders
            if h.shards and h.transfer_address and h.transfer_address != exclude
        }

    def describe(self) -> str:
        """One line for a log: `node<N>.<local_rank>@<address> [(layer, tp), ...]` per holder."""
        return "; ".join(
            f"node{h.node}.{h.local_rank}@{h.transfer_address or '-'} {list(h.shards)}" for h in self.holders
        ) or "no holder"


def holder_map_reader(client: EtcdClient, rk: RunKeys, *, revision: int | None = None) -> Callable[[], HolderMap]:
    """A reader of the holder map (at `revision`, see `HolderMap.read`) that goes to etcd on its
    first call only, so that the shard paths of one generation change (the collective exchange,
    then the gRPC fetch of what it did not bring) share one reading."""
    return functools.cache(functools.partial(HolderMap.read, client, rk, revision=revision))


def read_holdings(
    client: EtcdClient, rk: RunKeys, *, revision: int | None = None
) -> dict[tuple[int, int], tuple[ShardKey, ...]]:
    """(node, local_rank) -> the shards that worker reports holding: one read of `holdings/`
    (at `revision`, or the current one), a node's key (`holdings/<node>/all`) or a worker's own.
    The leader reads it to find shards without a live holder."""
    out: dict[tuple[int, int], tuple[ShardKey, ...]] = {}
    for value, meta in client.get_prefix(rk.holdings, revision=revision):
        node, last = meta.key.decode().rsplit("/", 2)[-2:]
        if last == NODE_KEY:
            record = NodeHoldings.from_json(value)
            for lr, held in record.held.items():
                out[(record.node, lr)] = tuple(ShardKey(layer, tp) for layer, tp in held)
        elif (int(node), int(last)) not in out:  # a node's key is the newer form
            out[(int(node), int(last))] = tuple(ShardKey(int(layer), int(tp)) for layer, tp in json.loads(value))
    return out

