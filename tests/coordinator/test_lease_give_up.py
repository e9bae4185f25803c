"""A kept lease gives up after `give_up_s` of etcd outage, and not before; without it, never."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from elastic.coordinator import EtcdConfig, EtcdServer, connect
from elastic.coordinator.lease import KeptLease
from elastic.coordinator.membership import MembershipConfig

pytestmark = pytest.mark.timeout(60)

TTL = 2


def _granted(server: EtcdServer, key: str | None = None) -> int:
    """A lease of TTL s (with `key` on it) granted by a client that retries: on a loaded machine
    the fresh etcd's first connection can time out, and only the outage that follows is under test."""
    setup = connect(EtcdConfig(endpoint=server.endpoint, retry_s=15.0))
    try:
        lease = setup.lease(TTL).id
        if key is not None:
            setup.put(key, "v", lease=lease)
        return lease
    finally:
        setup.close()


@pytest.mark.slow
def test_gives_up_after_a_long_outage_only_with_give_up(tmp_path: Path) -> None:
    with EtcdServer(data_dir=tmp_path / "etcd") as server:
        client = connect(EtcdConfig(endpoint=server.endpoint, retry_s=0.0))
        lost_at: list[float] = []
        giving_up = KeptLease(client, TTL, give_up_s=1.5, on_lost=lambda: lost_at.append(time.monotonic()),
                              lease_id=_granted(server))
        reference = KeptLease(client, TTL, lease_id=_granted(server))  # the same outage, no give-up: keeps retrying
        try:
            server.stop(kill=True)
            down_at = time.monotonic()
            assert giving_up.lost.wait(10.0), "the lease did not give up on an etcd gone for 10 s"
            assert giving_up.lost_reason.startswith("etcd unreachable for"), giving_up.lost_reason
            assert len(lost_at) == 1 and lost_at[0] - down_at >= 1.5, (lost_at, down_at)
            time.sleep(1.0)
            assert not reference.lost.is_set() and reference.lost_reason == ""
            assert len(lost_at) == 1, "on_lost ran more than once"
        finally:
            giving_up.stop_refreshing()
            reference.stop_refreshing()
            client.close()


@pytest.mark.slow
def test_an_outage_shorter_than_give_up_costs_nothing(tmp_path: Path) -> None:
    with EtcdServer(data_dir=tmp_path / "etcd") as server:
        client = connect(EtcdConfig(endpoint=server.endpoint, retry_s=0.0))
        lease = KeptLease(client, TTL, give_up_s=4.0, lease_id=_granted(server, "/give-up/key"))
        try:
            server.stop(kill=True)
            time.sleep(1.0)
            server.start()  # from this (the main) thread: etcd's PR_SET_PDEATHSIG follows it
            time.sleep(4.0 + TTL)  # past both the give-up time and the TTL
            assert not lease.lost.is_set(), lease.lost_reason
            assert client.get("/give-up/key")[0] == b"v", "the lease (and its key) did not survive"
        finally:
            lease.stop_refreshing()
            client.close()


@pytest.mark.parametrize("give_up", [0.0, -1.0])
def test_give_up_must_be_positive(give_up: float) -> None:
    with pytest.raises(ValueError, match="give_up_s must be > 0"):
        MembershipConfig(ttl=TTL, give_up_s=give_up)
