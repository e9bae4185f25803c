"""A private etcd whose picked port is taken before it binds it (by a listener here, as a
test run's other processes can) starts on new ports the first time, alone or as a cluster;
a restart keeps its ports (clients know them) and fails on a taken one, which is the reference:
the same taken port stops etcd when the server may not pick again."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from elastic.coordinator import EtcdConfig, connect
from elastic.coordinator.etcd_cluster import EtcdCluster
from elastic.coordinator.etcd_server import EtcdServer, free_port

pytestmark = [pytest.mark.timeout(120)]


@contextmanager
def _taken(port: int) -> Iterator[None]:
    """`port` on 127.0.0.1 held by a listener of this process."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the stopped etcd's TIME_WAITs
        sock.bind(("127.0.0.1", port))
        sock.listen()
        yield


def _answers(endpoint: str) -> str | None:
    client = connect(EtcdConfig(endpoint=endpoint))
    try:
        client.put("/ports/k", "v")
        value, _ = client.get("/ports/k")
        return value.decode() if value is not None else None
    finally:
        client.close()


def test_a_first_start_picks_new_ports_and_a_restart_keeps_them(tmp_path: Path) -> None:
    server = EtcdServer(data_dir=tmp_path / "etcd")
    lost_client, lost_peer = server.client_port, server.peer_port
    try:
        with _taken(lost_client), _taken(lost_peer):
            server.start()
            assert lost_client != server.client_port and lost_peer != server.peer_port
            assert _answers(server.endpoint) == "v"
        client_port = server.client_port
        server.stop()
        with _taken(client_port), pytest.raises(RuntimeError, match="etcd exited"):
            server.start()  # a restart may not move: its clients know the port
        assert server.client_port == client_port
        server.start()
        assert _answers(server.endpoint) == "v"  # the same data dir, on the same ports
    finally:
        server.close()


def test_a_cluster_whose_peer_port_is_taken_starts_on_new_ports(tmp_path: Path) -> None:
    cluster = EtcdCluster(3, data_dir=tmp_path / "etcd")
    lost = cluster.members[1].peer_port
    try:
        with _taken(lost):
            cluster.start()
        assert lost not in [m.peer_port for m in cluster.members]
        assert _answers(cluster.endpoint) == "v"
        assert cluster.leader() in range(3)
    finally:
        cluster.close()


def test_free_ports_are_below_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports), ports
