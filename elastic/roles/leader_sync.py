"""The leader's read of a halted generation's sync reports (elastic/roles/leader.py's round).

A node's workers' reports are one key, `sync/<g>/<node>/all` (elastic/records/node_sync.py); a
worker's own key, `sync/<g>/<node>/<local_rank>`, is read too. The leader keeps a mirror of
`sync/` (elastic/coordinator/prefix_mirror.py) that decodes each value as its watch delivers it,
so the round that finds the last report decodes nothing; the mirror is a speed-up, and etcd the
authority.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.keys import RunKeys
from elastic.coordinator.prefix_mirror import PrefixMirror
from elastic.records.node_sync import NODE_KEY, reports_of
from elastic.records.sync import SyncReport

log = logging.getLogger(__name__)


def sync_reports(client: EtcdClient, rk: RunKeys, mirror: PrefixMirror, g: int, expected: set[tuple[int, int]]
                 ) -> list[SyncReport] | None:
    """Every expected sync report of g, in (node, local_rank) order; None while some are missing.

    A node's workers' reports are one key, `sync/<g>/<node>/all` (elastic/records/node_sync.py); a
    worker's own key, `sync/<g>/<node>/<local_rank>`, is read too. From the leader's mirror of
    `sync/`, which decodes each value as its watch delivers it: a change's reports arrive over
    the time its nodes take to halt, and the round after the last one decodes nothing. The
    mirror is a speed-up, never the authority: while it lacks some, a count of the keys says
    whether etcd may have them all (a key a node at least), and if so they are read from etcd."""
    order = sorted(expected)
    nodes = sorted({node for node, _ in order})
    got = mirror.pick([*(f"{g}/{node}/{NODE_KEY}" for node in nodes), *(f"{g}/{node}/{lr}" for node, lr in order)])
    reports = _by_worker(got.items())
    picked = [reports[k] for k in order if k in reports]
    if len(picked) == len(order):
        return picked
    written = client.get_prefix_response(rk.sync(g), count_only=True)
    if int(written.count) < len(nodes):  # rounds woken by each report: count, don't read them all
        return None
    found = read_sync_reports(client, rk, g, expected)
    if found is not None:
        log.info("leader: generation %d: %d of %d sync reports are in etcd but not (yet) in the mirror",
                 g, len(order) - len(picked), len(order))
    return found


def _by_worker(values: Iterable[tuple[str, list[SyncReport]]]) -> dict[tuple[int, int], SyncReport]:
    """(node, local_rank) -> its report, from `sync/<g>/` values by key below `sync/` (a report under
    another node's or worker's key counts as missing)."""
    out: dict[tuple[int, int], SyncReport] = {}
    for key, reports in values:
        _, node, last = key.split("/")
        for r in reports:
            if str(r.node) == node and last in (NODE_KEY, str(r.local_rank)):
                out[(r.node, r.local_rank)] = r
    return out


def read_sync_reports(client: EtcdClient, rk: RunKeys, g: int, expected: set[tuple[int, int]]
                      ) -> list[SyncReport] | None:
    """Every expected sync report of g read from etcd, in (node, local_rank) order; None while some
    are missing or unreadable."""
    prefix = rk.prefix("sync")
    values: list[tuple[str, list[SyncReport]]] = []
    for value, meta in client.get_prefix(rk.sync(g)):
        try:
            values.append((meta.key.decode()[len(prefix):], reports_of(value)))
        except (ValueError, TypeError, KeyError):
            continue
    reports = _by_worker(values)
    if not expected <= reports.keys():
        return None
    return [reports[k] for k in sorted(expected)]
