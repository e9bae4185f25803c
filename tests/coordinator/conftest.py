"""Fixtures of the coordinator suite: member processes (etcd, job ids and clients: tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic.coordinator import EtcdServer

from .support import Members


@pytest.fixture
def members(etcd_server: EtcdServer, job: str, tmp_path: Path) -> Iterator[Members]:
    m = Members(etcd_server.endpoint, job, tmp_path)
    try:
        yield m
    finally:
        m.kill_all()
