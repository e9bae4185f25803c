"""Fixtures shared by the suites that need etcd: one real etcd server, unique job ids, a client."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from elastic.coordinator import EtcdConfig, EtcdServer, connect
from elastic.coordinator.etcd_server import NO_FSYNC_ENV
from elastic.roles.zygote import ZYGOTE_ENV, warm_enabled
from elastic.roles.zygote_client import Zygote
from tests.leftover_threads import ModuleThreads

os.environ.setdefault(NO_FSYNC_ENV, "1")
"""Every etcd the suite starts, here or in its `elastic run` subprocesses, skips fsync: a stall
of this machine's disk (5-13 s seen) must not fence the nodes of a test about something else.
A test about a slow disk under etcd sets it to 0 for its own etcd."""


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
    "tests/engine/test_sharded_optimizer.py",
    "tests/model/test_model.py", "tests/model/test_tensor_parallel.py", "tests/transfer/test_collective.py",
    "tests/bench/test_nccl_smoke.py", "tests/comm/test_abandon.py", "tests/model/test_recompute.py",
    "tests/bench/test_recompute_bench.py", "tests/engine/test_saved_activations.py",
    "tests/comm/test_scatter_gather.py", "tests/model/test_llama.py", "tests/comm/test_sharded_bytes.py",
    "tests/comm/test_slice_owners.py", "tests/comm/test_sliced_checkpoint.py",
})
"""Slow modules that start no job, etcd or timed fault: compute and gloo on threads or processes
of their own, with no deadline nearer than their timeouts."""


PURE_UNITS = (
    "tests/templates/", "tests/planning/", "tests/sim/", "tests/records/", "tests/comm/test_nccl_model.py",
    "tests/comm/test_opening.py",
    "tests/engine/test_schedule.py", "tests/engine/test_blocks.py", "tests/engine/test_optim.py", "tests/engine/test_adamw_slices.py",
    "tests/engine/test_layout.py", "tests/engine/test_partial_plan.py", "tests/engine/test_eval_unit.py",
    "tests/engine/test_transaction.py", "tests/engine/test_grad_sync.py", "tests/engine/test_vote.py",
    "tests/engine/test_device.py", "tests/engine/test_rebuild.py", "tests/coordinator/test_jsonrecord.py",
    "tests/data/test_dataset.py", "tests/data/test_held_out.py", "tests/data/test_prepare_data.py",
    "tests/transfer/test_codec.py", "tests/transfer/test_shards.py", "tests/transfer/test_wire.py",
    "tests/transfer/test_stubs_fresh.py", "tests/ops/test_report.py", "tests/roles/test_straggler_decisions.py",
    "tests/roles/test_leader_decisions.py", "tests/roles/test_node_list.py",
    "tests/test_function_length.py", "tests/test_layers.py", "tests/model/test_shape_flags.py",
    "tests/checkpoint/test_policy.py", "tests/checkpoint/test_reshard.py",
)
"""Modules (and folders) of units and small computations: no etcd, lease, job or timed fault of
their own, and no deadline nearer than their timeouts (a static `launch` at most)."""

LANE_ENV = "ELASTIC_TEST_LANE"
"""`scripts/test.sh` runs the suite as two pytest sessions at once: `background` (the modules of
PARALLEL_SAFE and PURE_UNITS, under `nice`) and `live` (every other test). Each session collects
everything and deselects the other lane's tests. Unset: one session runs every test."""


def background_lane(path: str) -> bool:
    """Whether the test module at `path` (relative to the repository) runs in the background lane."""
    return path in PARALLEL_SAFE or path.startswith(PURE_UNITS)


def pytest_configure(config: pytest.Config) -> None:
    """`-n` (pytest-xdist) only with `--dist loadgroup`: the groups below are what keeps the live
    tests on one worker. The background lane runs at the kernel's idle priority (SCHED_IDLE, with
    every process it starts): it takes a core only when no live test wants it."""
    if os.environ.get(LANE_ENV) == "background" and hasattr(os, "sched_setscheduler"):
        with contextlib.suppress(OSError):  # not permitted here: `nice` (scripts/test.sh) is what remains
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    if getattr(config.option, "numprocesses", None) and config.option.dist != "loadgroup":
        raise pytest.UsageError(f"-n without --dist loadgroup (got --dist {config.option.dist}): "
                                "the live tests must run on one worker, see tests/conftest.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (opt-in: `bash scripts/test.sh -n 2 --dist loadgroup`), one worker runs
    every live test in file order: a job, an etcd, a lease or a timed fault (marked slow, or on the
    session's etcd) shares the machine with at most one other test, and never with another live
    one, so a TTL or a timing check sees about the load of a serial run. Every other module is a
    group of its own (its module fixtures are built once), spread over both workers. The workers
    collect (they carry `workerinput`); the controller only schedules. Under `$ELASTIC_TEST_LANE`
    the other lane's tests are deselected first."""
    root = config.rootpath
    lane = os.environ.get(LANE_ENV)
    if lane is not None:
        if lane not in ("background", "live"):
            raise pytest.UsageError(f"${LANE_ENV} must be background or live, got {lane!r}")
        keep, drop = [], []
        for item in items:
            mine = background_lane(item.path.relative_to(root).as_posix()) == (lane == "background")
            (keep if mine else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    if not hasattr(config, "workerinput"):
        return
    for item in items:
        path = item.path.relative_to(root).as_posix()
        live = path not in PARALLEL_SAFE and (
            item.get_closest_marker("slow") is not None or "etcd_server" in getattr(item, "fixturenames", ()))
        item.add_marker(pytest.mark.xdist_group("live" if live else path))


THREADS = ModuleThreads()
"""Every module ends with no more gloo or generation threads than it started with
(tests/leftover_threads.py)."""


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    THREADS.setup(item)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Outermost: the check runs after every other teardown, the logging plugin's too (it keeps
    the last test's log records, whose errors' tracebacks hold that test's objects, until then)."""
    yield
    THREADS.teardown(item, nextitem)
