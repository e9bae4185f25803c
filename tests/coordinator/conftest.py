"""Fixtures of the coordinator suite: a real etcd server, member processes, unique job ids."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic.coordinator import EtcdConfig, EtcdServer, connect

from .support import Members


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


@pytest.fixture
def members(etcd_server: EtcdServer, job: str, tmp_path: Path) -> Iterator[Members]:
    m = Members(etcd_server.endpoint, job, tmp_path)
    try:
        yield m
    finally:
        m.kill_all()
