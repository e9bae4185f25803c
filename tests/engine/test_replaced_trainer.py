"""A trainer replaced by a fresh one (a checkpoint fallback drops the newer state) must not take
its process groups down with it: destroying a gloo group that has an abandoned operation
pending blocks until the group's timeout. The fresh trainer inherits them (`inherit_groups`);
the reference is the same replacement without it, which blocks."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic.engine.trainer import Trainer
from elastic.records.job import JobSpec
from templates.plan import even_plan
from tests.engine.runs import OPTIM

pytestmark = pytest.mark.timeout(120)

GROUP_TIMEOUT_S = 10.0


def _abandoned_pair(tmp_path: Path) -> tuple[JobSpec, Trainer, Trainer]:
    """Two ranks' trainers in generation 1 (threads, one store); rank 0 then posts a world
    all-reduce rank 1 never joins and abandons it, as an aborted step does. Both trainers (rank 1
    must stay alive: its groups' end would fail the pending operation at once)."""
    plan = even_plan(num_layers=6, nodes=[0, 1], num_pipelines=2, global_microbatches=2, microbatch_size=1)
    spec = JobSpec(model="tiny", plan=plan, steps=2, run_dir=str(tmp_path), optim=OPTIM, device="cpu",
                   collective_timeout_s=GROUP_TIMEOUT_S)
    store = dist.HashStore()
    trainers: list[Trainer | BaseException] = [RuntimeError("not started")] * 2

    def start(node: int) -> None:
        try:
            t = Trainer(spec, node=node, local_rank=0)
            t.start(plan=plan, generation=1, store=store, abort=None, fetch=None, step=0)
            t.train(1)  # connects the pair
            trainers[node] = t
        except BaseException as exc:
            trainers[node] = exc

    threads = [threading.Thread(target=start, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    first = trainers[0]
    assert isinstance(first, Trainer) and isinstance(trainers[1], Trainer), trainers
    work = first.groups.world.all_reduce(torch.zeros(4))
    threading.Thread(target=lambda: _swallow(work.wait), daemon=True).start()  # the abandoned wait
    return spec, first, trainers[1]


def _swallow(fn: Callable[[], object]) -> None:
    with contextlib.suppress(RuntimeError):  # the group's timeout, or its peer's end, ends it
        fn()


def _replace_and_collect(spec: JobSpec, old: Trainer, keep: list[Trainer], *, inherit: bool) -> threading.Thread:
    """Replace `old` by a fresh trainer (inheriting its groups or not; appended to `keep`, which
    the caller holds), drop `old` and collect, on a thread of its own; the thread, not started:
    the caller drops its own reference to `old` first. The fresh trainer is built here, before
    the thread: only the replacement itself is timed (on a loaded CI machine building a model
    took most of the window)."""
    holder = [old]
    fresh = Trainer(spec, node=0, local_rank=0)

    def run() -> None:
        if inherit:
            fresh.inherit_groups(holder[0])
        keep.append(fresh)
        holder.clear()
        gc.collect()

    return threading.Thread(target=run, daemon=True)


@pytest.mark.slow
@pytest.mark.parametrize("inherit", [True, False])
def test_a_replaced_trainer_leaves_its_groups_alive(tmp_path: Path, inherit: bool) -> None:
    spec, old, peer = _abandoned_pair(tmp_path)
    keep: list[Trainer] = []
    thread = _replace_and_collect(spec, old, keep, inherit=inherit)
    del old
    thread.start()
    thread.join(GROUP_TIMEOUT_S / 2)
    if inherit:
        assert not thread.is_alive(), "replacing the trainer blocked on its old process groups"
    else:  # the reference: without inherit_groups the old groups' destruction waits for the timeout
        assert thread.is_alive(), "dropping a group with a pending operation did not block: the test proves nothing"
        thread.join(GROUP_TIMEOUT_S * 2)
    del peer  # the end of rank 1's groups fails the pending operation; then nothing is left pending
    time.sleep(0.5)
    keep.clear()
    gc.collect()
