"""A client's kept leases share one LeaseKeepAlive stream (elastic/coordinator/lease_stream.py).

Each test runs its own etcd and reads etcd's own counters (`grpc_server_started_total` of the
LeaseKeepAlive method: streams opened) and lease state (`get_lease_info`), so what is checked is
what the server saw, not what the client believes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from elastic.coordinator import EtcdConfig, EtcdServer, connect
from elastic.coordinator.lease import KeptLease

from .test_store_api import etcd_requests

TTL = 2
INTERVAL = 0.25


@pytest.fixture
def own_etcd() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


def _alive(client: Any, lease: KeptLease) -> bool:
    return int(client.get_lease_info(lease.id).TTL) > 0


@pytest.mark.timeout(60)
def test_leases_of_a_client_share_one_stream_and_stay_alive(own_etcd: EtcdServer) -> None:
    client = connect(EtcdConfig(endpoint=own_etcd.endpoint))
    before = etcd_requests(own_etcd.endpoint, "LeaseKeepAlive")
    leases = [KeptLease(client, TTL, interval=INTERVAL, name=f"l{i}") for i in range(5)]
    for i, lease in enumerate(leases):
        client.put(f"/lease-stream/{i}", "x", lease=lease.id)
    time.sleep(3 * TTL)  # three TTLs: 120 refreshes in all
    assert all(_alive(client, lease) for lease in leases)
    assert client.get_prefix_response("/lease-stream/").count == 5
    assert etcd_requests(own_etcd.endpoint, "LeaseKeepAlive") - before == 1  # was one a refresh

    leases[0].stop_refreshing()  # its refreshes stop: it alone expires, on the same stream
    time.sleep(TTL + 1.5)
    assert not _alive(client, leases[0]) and all(_alive(client, lease) for lease in leases[1:])
    assert client.get_prefix_response("/lease-stream/").count == 4
    assert not any(lease.lost.is_set() for lease in leases)

    for lease in leases[1:]:
        lease.revoke()
    assert etcd_requests(own_etcd.endpoint, "LeaseKeepAlive") - before == 1
    client.close()


@pytest.mark.timeout(60)
def test_an_expired_lease_is_lost_and_the_others_stay(own_etcd: EtcdServer) -> None:
    client = connect(EtcdConfig(endpoint=own_etcd.endpoint))
    kept = KeptLease(client, TTL, interval=INTERVAL)
    doomed = KeptLease(client, TTL, interval=INTERVAL)
    client.revoke_lease(doomed.id)  # gone on the server: the next answer has TTL <= 0
    assert doomed.lost.wait(5) and doomed.lost_reason == "lease expired"
    time.sleep(2 * TTL)
    assert _alive(client, kept) and not kept.lost.is_set()
    kept.revoke()
    client.close()


@pytest.mark.timeout(90)
def test_leases_survive_an_etcd_restart_on_a_new_stream(own_etcd: EtcdServer) -> None:
    client = connect(EtcdConfig(endpoint=own_etcd.endpoint))
    leases = [KeptLease(client, 6, interval=0.5) for _ in range(3)]
    for i, lease in enumerate(leases):
        client.put(f"/restart/{i}", "x", lease=lease.id)
    time.sleep(1.0)
    own_etcd.stop(kill=True)  # SIGKILL
    time.sleep(1.0)  # refreshes fail meanwhile (the stream broke) and are retried
    own_etcd.start()
    time.sleep(3.0)
    assert all(_alive(client, lease) for lease in leases) and not any(lease.lost.is_set() for lease in leases)
    opened = etcd_requests(own_etcd.endpoint, "LeaseKeepAlive")  # counters restart with etcd
    time.sleep(8.0)  # longer than the TTL: the refreshes on the new stream keep them
    assert all(_alive(client, lease) for lease in leases)
    assert client.get_prefix_response("/restart/").count == 3
    assert etcd_requests(own_etcd.endpoint, "LeaseKeepAlive") == opened == 1
    for lease in leases:
        lease.revoke()
    client.close()
