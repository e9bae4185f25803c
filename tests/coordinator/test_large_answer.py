"""An etcd answer larger than gRPC's 4 MiB client default reaches the client whole: at 16,384
workers one generation's sync reports are 3 MB (bench/control_plane_light.py), and a read of a
whole job more."""

from __future__ import annotations

import pytest

from elastic.coordinator import EtcdConfig, EtcdServer, connect

pytestmark = pytest.mark.timeout(60)

VALUE = 1_000_000
"""Bytes a key (under etcd's 1.5 MiB request limit)."""
KEYS = 6
"""6 MB in one answer."""


def test_a_prefix_read_of_6_mb_arrives_whole(etcd_server: EtcdServer) -> None:
    client = connect(EtcdConfig(endpoint=etcd_server.endpoint))
    try:
        values = {f"/large/{i}": bytes([65 + i]) * VALUE for i in range(KEYS)}
        for key, value in values.items():
            client.put(key, value)
        read = {meta.key.decode(): value for value, meta in client.get_prefix("/large/")}
        assert read == values
    finally:
        client.delete_prefix("/large/")
        client.close()
