"""A superseded generation's recovery records folded into one key (issue 34: the db stays small).

Every node writes `recoveries/<g>/<node>` once it commits in generation g, so each change adds
O(nodes) keys, and they were kept for the whole job: 0.59 MB a change at 16,384 workers, about
250 MB after Llama 3's 419 interruptions. Their readers (the launcher's recovery line, `status`,
`events`, the metrics) only take maxima, sums and the set of ranks, which one folded record
keeps (elastic/records/recovery_timings.py `summary_of`).

When the leader publishes g+1 it folds g's node records into `recoveries/<g>/all` and deletes
them, in one transaction that holds only if no node record changed since it read them. g is then
superseded: its workers have halted, so a record of g can only be one in flight. One that lands
after the fold (a relay's compare-and-swap then finds its key gone and writes it anew, holding
only ranks the summary lacks) is folded in when g+2 is published, which sweeps g again. Readers
count such a record beside the summary once.
"""

from __future__ import annotations

import dataclasses
import logging

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.keys import RunKeys
from elastic.records.recovery_timings import SUMMARY_NODE, RecoveryTimings, summary_of

log = logging.getLogger(__name__)

ATTEMPTS = 3
"""Reads and compare-and-swaps of one generation's fold before leaving it as it is."""


def summary_key(rk: RunKeys, generation: int) -> str:
    """`recoveries/<g>/all`: generation g's node records, folded."""
    return rk.job.key("recovered", generation)


def node_records(rk: RunKeys, generation: int) -> tuple[str, str]:
    """The key range [start, end) of generation g's node records (digits only: its summary lies
    outside it)."""
    prefix = rk.prefix("recoveries", generation)
    return prefix + "0", prefix + ":"  # ':' follows '9'


def fold_generation(client: EtcdClient, rk: RunKeys, g: int) -> int:
    """Fold generation `g`'s node records into its summary and delete them; how many were
    folded (0: none there, or every attempt lost to a writer, or the records cannot be folded;
    the records are then left as they are, and readers still read them)."""
    start, end = node_records(rk, g)
    key = summary_key(rk, g)
    for _ in range(ATTEMPTS):
        resp = client.get_range_response(start, end)
        if not resp.kvs:
            return 0
        try:
            by_node = {int(kv.key.decode().rsplit("/", 1)[1]): RecoveryTimings.from_json(kv.value) for kv in resp.kvs}
            old, _ = client.get(key)
            if old is not None:
                by_node[SUMMARY_NODE] = RecoveryTimings.from_json(old)
            summary = summary_of(by_node)
            last = max([kv.mod_revision for kv in resp.kvs]
                       + [r.last_revision for r in by_node.values() if r.last_revision is not None])
        except ValueError as exc:  # a malformed record, or two that overlap in part: readers see them as they are
            log.warning("recoveries of generation %d left unfolded: %s", g, exc)
            return 0
        assert summary is not None
        summary = dataclasses.replace(summary, last_revision=last)
        txn = client.transactions
        ok, _ = client.transaction(
            compare=[txn.mod(start, end) < int(resp.header.revision) + 1,
                     txn.version(key) == 0 if old is None else txn.value(key) == old],
            success=[txn.put(key, summary.to_packed()), txn.delete(start, range_end=end)],
            failure=[],
        )
        if ok:
            return len(resp.kvs)
    log.warning("recoveries of generation %d left unfolded: %d attempts lost to a writer", g, ATTEMPTS)
    return 0
