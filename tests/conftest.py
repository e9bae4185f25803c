"""Fixtures shared by the suites that need etcd: one real etcd server, unique job ids, a client."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from elastic.coordinator import EtcdConfig, EtcdServer, connect
from elastic.roles.zygote import ZYGOTE_ENV, Zygote, warm_enabled


@pytest.fixture(scope="session", autouse=True)
def warm_parent() -> Iterator[None]:
    """One warm parent for every job the suite starts (elastic/roles/zygote.py): launchers, in
    this process or in `elastic run` subprocesses, find it in $ELASTIC_ZYGOTE and fork their
    agents and workers from it, as a launcher forks them from its own. ELASTIC_WARM=0 runs the
    suite on fresh interpreters."""
    if not warm_enabled() or os.environ.get(ZYGOTE_ENV):
        yield
        return
    with Zygote() as zygote:
        os.environ[ZYGOTE_ENV] = zygote.path
        try:
            yield
        finally:
            os.environ.pop(ZYGOTE_ENV, None)


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
