"""Restart etcd on the same data directory under a live membership."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from elastic.coordinator import EtcdConfig, EtcdServer, JobKeys, connect
from elastic.coordinator.membership import read_members

from .support import Members, wait_for

TTL = 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_restart_keeps_members_and_watches(tmp_path: Path) -> None:
    with EtcdServer(data_dir=tmp_path / "etcd") as server:
        members = Members(server.endpoint, "restart", tmp_path)
        try:
            for n in ("n0", "n1", "n2"):
                members.start(n, ttl=TTL)
            members.wait_ready("n0", "n1", "n2")
            client = connect(EtcdConfig(endpoint=server.endpoint))
            keys = JobKeys("restart")
            assert set(read_members(client, keys)[0]) == {"n0", "n1", "n2"}
            server.stop(kill=True)  # a crash, not a clean shutdown
            time.sleep(1.0)
            server.start()
            # Watches resume: a member joining after the restart is seen by everyone.
            members.start("n3", ttl=TTL)
            members.wait_ready("n3")
            for n in ("n0", "n1", "n2"):
                wait_for(lambda n=n: any(r["event"] == "join" and r["node"] == "n3" for r in members.records(n)),
                         10.0, f"{n} to see n3 join after the restart")
            time.sleep(2 * TTL)  # long enough for any lease that was not kept alive to expire
            assert set(read_members(client, keys)[0]) == {"n0", "n1", "n2", "n3"}
            for n in ("n0", "n1", "n2", "n3"):
                assert [r for r in members.records(n) if r["event"] == "loss"] == [], f"{n} reported a loss"
            client.close()
        finally:
            members.kill_all()
