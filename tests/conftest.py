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


PARALLEL_SAFE = frozenset({
    "tests/comm/test_real_paths.py", "tests/engine/test_equivalence.py", "tests/engine/test_memory_model.py",
    "tests/model/test_model.py", "tests/model/test_tensor_parallel.py", "tests/transfer/test_collective.py",
})
"""Slow modules that start no job, etcd or timed fault: compute and gloo on threads or processes
of their own, with no deadline nearer than their timeouts."""


def pytest_configure(config: pytest.Config) -> None:
    """`-n` (pytest-xdist) only with `--dist loadgroup`: the groups below are what keeps the live
    tests on one worker."""
    if getattr(config.option, "numprocesses", None) and config.option.dist != "loadgroup":
        raise pytest.UsageError(f"-n without --dist loadgroup (got --dist {config.option.dist}): "
                                "the live tests must run on one worker, see tests/conftest.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (opt-in: `bash scripts/test.sh -n 2 --dist loadgroup`), one worker runs
    every live test in file order: a job, an etcd, a lease or a timed fault (marked slow, or on the
    session's etcd) shares the machine with at most one other test, and never with another live
    one, so a TTL or a timing check sees about the load of a serial run. Every other module is a
    group of its own (its module fixtures are built once), spread over both workers. The workers
    collect (they carry `workerinput`); the controller only schedules."""
    if not hasattr(config, "workerinput"):
        return
    root = config.rootpath
    for item in items:
        path = item.path.relative_to(root).as_posix()
        live = path not in PARALLEL_SAFE and (
            item.get_closest_marker("slow") is not None or "etcd_server" in getattr(item, "fixturenames", ()))
        item.add_marker(pytest.mark.xdist_group("live" if live else path))
