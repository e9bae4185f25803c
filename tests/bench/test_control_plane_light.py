"""bench/control_plane_light.py at a small size, against a real etcd and real shard processes: the
figures it reports are the protocol's, counted from what etcd saw.

The reference is the runtime's protocol: a change costs each live node one transaction for its
workers' sync reports (with their holdings where they changed) and one for their recovery records,
plus the leader's own handful (with its fold of the superseded generation's recovery records); a progress put wakes one watcher per waiting agent and the bench's observer (the
launcher's watch), no one else.
"""

from __future__ import annotations

import pytest

from bench.control_plane_light import run_one

NODES = 16
CHANGES = 2
WAITING = 3


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_light_nodes_change_generations_at_the_protocols_cost() -> None:
    out = run_one(nodes=NODES, steps=45, changes=CHANGES, pace_ms=20.0, procs=2, nodes_per_client=1,
                  waiting=WAITING)
    changes = out["changes_detail"]
    assert [c["generation"] for c in changes] == [2, 3]
    for c in changes:
        assert c["valid"], c  # the leader's record names the node the bench reported lost
        live = c["live_nodes"]
        fams = c["writes_by_family"]
        # one transaction a node: its workers' reports (one key), with their holdings where they changed
        synced = fams.get("holdings+sync", 0) + fams.get("sync", 0)
        assert synced == live, fams
        # one a node (its workers' recovery records), and the leader's fold of the superseded generation's
        assert fams.get("recoveries") == live + 1, fams
        node_writes = synced + fams["recoveries"]
        assert c["etcd"]["writes"] - node_writes <= 10, fams  # the leader's and the failure's own
        # Causal order of what the nodes noted (the bench's own watch may see a key late):
        # every node halted before the last sync report, which the leader awaited to publish.
        assert 0 < c["halt_seen_all_s"] <= c["syncs_written_s"] < c["arrived_all_s"] <= c["all_seen_s"]
        assert c["halt_written_s"] > 0 and c["published_s"] > 0
        assert not c["leases_lost"]
    steady = out["steady"]
    assert steady["waiting_nodes"] == WAITING
    assert steady["events_per_put"] == pytest.approx(WAITING + 1, abs=0.3)  # the waiting agents and the launcher
    assert out["end"]["db_bytes"] > 0
