"""Fixtures shared by the suites that need etcd: one real etcd server, unique job ids, a client."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from elastic.coordinator import EtcdConfig, EtcdServer, connect


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    """One etcd for the session; tests isolate themselves with unique job ids."""
    with EtcdServer() as server:
        yield server


@pytest.fixture
def job() -> str:
    return f"job-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def client(etcd_server: EtcdServer) -> Iterator[Any]:
    c = connect(EtcdConfig(endpoint=etcd_server.endpoint))
    yield c
    c.close()
