"""A node's etcd writes as transactions: plain puts, and records folded a node a key.

A plain put is (key, value, lease). A fold is one worker's record destined for its node's key
(issue 34: records a node, not a worker), with the lease the key is written on if any: its
`RecoveryTimings` at `recoveries/<g>/<node>`, its sync report (a `NodeSyncReports` of one) at
`sync/<g>/<node>/all`, its holdings (a `NodeHoldings` of one) at `holdings/<node>/all`, its
registration (a `NodeWorkers` of one) at `workers/<node>/all`. A folded record is stored as
`to_packed` gives it (zlib-compressed when large). The node's agent
(elastic/roles/node_relay.py) folds its workers' records and writes them with their other puts
in one transaction; a worker without an agent folds its own in the same way. Both may write the
same key, so a fold is a compare-and-swap: the transaction holds only if the key still has the
value the writer folded into (`known`, or absent), else the writer reads the key, folds again
and retries. Folding is idempotent (a record already in is not added again), so a retry, or a
worker that falls back to writing its record itself after its agent wrote it, counts nothing
twice. In the usual case (one writer a node, the key absent or last written by it) a batch is
still one transaction.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import reduce

from elastic.coordinator.etcd_api import EtcdClient
from elastic.records.node_holdings import NodeHoldings
from elastic.records.node_sync import NodeSyncReports
from elastic.records.node_workers import NodeWorkers
from elastic.records.recovery_timings import RecoveryTimings

MAX_TXN_OPS = 128
"""etcd's default --max-txn-ops: a larger batch is written as several transactions."""

FOLD_ATTEMPTS = 20
"""Compare-and-swap attempts of one batch before giving up (each loses only to another writer's
successful fold of the same key: a node has few writers)."""

Put = tuple[str, str, int | None]
"""(key, value, lease id or None)."""

Foldable = RecoveryTimings | NodeSyncReports | NodeHoldings | NodeWorkers
"""A record that folds into its node's key: `a.fold(b)`, idempotent."""

Fold = tuple[str, Foldable] | tuple[str, Foldable, int | None]
"""(a node's key, one worker's record to fold into it[, the lease the key is written on])."""

FOLD_KINDS: dict[str, type[Foldable]] = {"recovery": RecoveryTimings, "sync": NodeSyncReports,
                                         "holdings": NodeHoldings, "workers": NodeWorkers}
"""The relay's wire name of each kind of fold."""


def fold_kind(record: Foldable) -> str:
    """`record`'s name in `FOLD_KINDS`."""
    return next(name for name, kind in FOLD_KINDS.items() if isinstance(record, kind))


def fold_lease(fold: Fold) -> int | None:
    """The lease `fold`'s key is written on (None: none)."""
    return fold[2] if len(fold) > 2 else None


class FoldConflict(RuntimeError):
    """A fold lost its compare-and-swap `FOLD_ATTEMPTS` times in a row."""


def write_puts(client: EtcdClient, puts: list[Put]) -> int:
    """Write `puts` as one etcd transaction (several past etcd's `MAX_TXN_OPS`); how many."""
    ops = [client.transactions.put(k, v, lease=lease) for k, v, lease in puts]
    for i in range(0, len(ops), MAX_TXN_OPS):
        client.transaction(compare=[], success=ops[i:i + MAX_TXN_OPS], failure=[])
    return -(-len(ops) // MAX_TXN_OPS)


def write_batch(client: EtcdClient, puts: list[Put], folds: Iterable[Fold], known: dict[str, bytes | None]) -> int:
    """Write `puts` and fold `folds` into their keys, together in one transaction while they fit
    etcd's `MAX_TXN_OPS` (the rest of the puts after it); how many transactions were written.

    `known` maps a folded key to the value this writer last saw there (None: absent); a key not
    in it is taken to be absent. It is updated to what was written. FoldConflict after
    `FOLD_ATTEMPTS` lost compare-and-swaps."""
    by_key: dict[str, list[Foldable]] = {}
    leases: dict[str, int | None] = {}
    for fold in folds:
        by_key.setdefault(fold[0], []).append(fold[1])
        leases[fold[0]] = leases.get(fold[0]) or fold_lease(fold)
    if not by_key:
        return write_puts(client, puts)
    head = max(0, MAX_TXN_OPS - 2 * len(by_key))
    for _ in range(FOLD_ATTEMPTS):
        compares, ops, written = [], [], {}
        for key, records in by_key.items():
            seen = known.get(key)
            start = records if seen is None else [type(records[0]).from_json(seen), *records]
            value = reduce(lambda a, b: a.fold(b), start).to_packed()  # type: ignore[arg-type]
            compares.append(client.transactions.version(key) == 0 if seen is None
                            else client.transactions.value(key) == seen)
            ops.append(client.transactions.put(key, value, lease=leases[key]))
            written[key] = value
        ops += [client.transactions.put(k, v, lease=lease) for k, v, lease in puts[:head]]
        ok, _ = client.transaction(compare=compares, success=ops, failure=[])
        if ok:
            known.update(written)
            return 1 + (write_puts(client, puts[head:]) if puts[head:] else 0)
        for key in by_key:  # another writer folded first: start from what it wrote
            known[key] = client.get(key)[0]
    raise FoldConflict(f"folding into {sorted(by_key)} lost {FOLD_ATTEMPTS} compare-and-swaps in a row")
