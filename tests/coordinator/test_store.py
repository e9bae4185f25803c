"""The etcd-backed c10d Store: semantics against TCPStore's, and gloo init + all_reduce on 4 processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from elastic.coordinator import EtcdServer, EtcdStore, JobKeys

from .support import REPO

WORKER = r"""
import sys, torch, torch.distributed as dist
from datetime import timedelta
from elastic.coordinator import EtcdConfig, EtcdStore, JobKeys, connect
endpoint, job, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
client = connect(EtcdConfig(endpoint=endpoint))
for gen in (1, 2):
    store = EtcdStore(client, JobKeys(job).store(f"gen-{gen}"), timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    x = torch.tensor([float(rank + 1) * gen, float(dist.get_world_size())])
    dist.all_reduce(x)
    print(f"gen={gen} sum={x[0].item()} world={x[1].item()}", flush=True)
    dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_gloo_all_reduce_over_etcd_store_twice(etcd_server: EtcdServer, job: str) -> None:
    world = 4
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, etcd_server.endpoint, job, str(r), str(world)],
            stdout=subprocess.PIPE,
            env=env,
        )
        for r in range(world)
    ]
    try:
        outs = [p.communicate(timeout=100)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    reference = sum(range(1, world + 1))  # the sum a single process computes
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
        assert out.splitlines() == [
            f"gen=1 sum={float(reference)} world={float(world * world)}",
            f"gen=2 sum={float(2 * reference)} world={float(world * world)}",
        ]


@pytest.mark.timeout(30)
def test_store_semantics(client: Any, job: str) -> None:
    store = EtcdStore(client, JobKeys(job).store("gen-1"), timeout=timedelta(seconds=5))
    store.set("a", "1")
    assert store.get("a") == b"1"
    assert store.add("n", 3) == 3 and store.add("n", -1) == 2
    assert store.compare_set("a", "1", "2") == b"2"
    assert store.compare_set("a", "1", "3") == b"2"  # mismatch: current value
    assert store.compare_set("new", "", "x") == b"x"  # empty expected matches a missing key
    assert store.compare_set("missing", "e", "x") == b"e"
    assert store.check(["a", "n"]) and not store.check(["a", "nope"])
    assert store.num_keys() == 3
    assert store.delete_key("a") and not store.delete_key("a")
    other = EtcdStore(client, JobKeys(job).store("gen-2"))
    assert other.num_keys() == 0 and not other.check(["n"])  # generations do not see each other


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_blocking_get_wakes_on_write_and_times_out(client: Any, job: str) -> None:
    store = EtcdStore(client, JobKeys(job).store("gen-1"), timeout=timedelta(seconds=10))
    threading.Timer(0.5, lambda: store.set("late", "v")).start()
    t0 = time.monotonic()
    assert store.get("late") == b"v"
    assert 0.4 < time.monotonic() - t0 < 5.0
    store.set_timeout(timedelta(seconds=1))
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"])
    assert 0.9 < time.monotonic() - t0 < 5.0
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"], timedelta(seconds=0.3))
