"""Real gloo groups on EtcdStore through `build_groups`: 4 ranks (threads of one process, each
with its own store), eager and lazy (TORCH_GLOO_LAZY_INIT=1) connection, each rank handing
`build_groups` a temporary store. The lazy groups reach the store at their first collective,
after the caller dropped it: pytorch#115977 ("pure virtual Store::wait") unless something holds
it (an EtcdStore holds itself until released, and the groups hold theirs). A control run
releases the store and drops the groups' reference, and must hit that very error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elastic.coordinator import EtcdServer

from .support import REPO

RANKS = r"""
import dataclasses, gc, sys, threading
from datetime import timedelta
import torch
from elastic.coordinator import EtcdConfig, EtcdStore, JobKeys, connect
from elastic.parallel.groups import build_groups
from elastic.parallel.layout import ParallelLayout
from tests.engine.plans import two_by_two

endpoint, job, drop = sys.argv[1], sys.argv[2], sys.argv[3] == "drop"
client = connect(EtcdConfig(endpoint=endpoint))
plan = two_by_two()
out = [""] * 4

def rank_main(rank: int) -> None:
    layout = ParallelLayout.for_rank(plan, 1, rank)
    store = EtcdStore(client, JobKeys(job).store("gen-1"), timeout=timedelta(seconds=20))
    groups = build_groups(layout, store, timeout=timedelta(seconds=20))
    if drop:  # the control: neither the store itself nor the groups keep it
        store.release()
        groups = dataclasses.replace(groups, store=None)
    del store
    gc.collect()
    try:
        x = torch.tensor([float(rank + 1)])
        groups.wait(groups.world.all_reduce(x))
        (ranks,) = [r for r, g in groups.buckets.items() if g is not None]
        y = torch.tensor([float(rank + 1)])
        groups.wait(groups.buckets[ranks].all_reduce(y))
        out[rank] = f"world={x.item()} bucket{ranks}={y.item()}"
    except RuntimeError as exc:
        out[rank] = f"error: {exc}"

threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print("\n".join(out), flush=True)
"""


def run_ranks(endpoint: str, job: str, *, lazy: bool, drop: bool) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_GLOO_LAZY_INIT": "1" if lazy else "0"}
    proc = subprocess.run(
        [sys.executable, "-c", RANKS, endpoint, job, "drop" if drop else "keep"],
        capture_output=True, env=env, timeout=60, text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_groups_on_a_temporary_store(etcd_server: EtcdServer, job: str, lazy: bool) -> None:
    lines = run_ranks(etcd_server.endpoint, job, lazy=lazy, drop=False)
    # two_by_two: pipelines {0, 1} and {2, 3}; rank r and r + 2 hold the same layers.
    assert lines == [
        f"world=10.0 bucket{(r % 2, r % 2 + 2)}={float((r % 2 + 1) + (r % 2 + 3))}" for r in range(4)
    ]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_lazy_groups_fail_without_the_held_store(etcd_server: EtcdServer, job: str) -> None:
    lines = run_ranks(etcd_server.endpoint, job, lazy=True, drop=True)
    assert len(lines) >= 4 and all("pure virtual" in line for line in lines[:4]), lines
