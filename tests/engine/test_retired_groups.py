"""A retired generation's gloo groups are closed once the next generation commits a step: an
operation abandoned on them ends then (with the error of the closed pairs), not at the group's
timeout, and their connections leave gloo's loop. Before that commit they stay open (a slower
peer may still be finishing the old generation). Real gloo groups of two trainers (threads)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic.engine.trainer import Trainer
from elastic.records.job import JobSpec
from templates.plan import even_plan
from tests.engine.runs import OPTIM
from tests.leftover_threads import generation_threads, left_behind

pytestmark = pytest.mark.timeout(120)

GROUP_TIMEOUT_S = 30.0


def _both(fn: object, trainers: list[Trainer]) -> None:
    """Run `fn(trainer)` for both trainers at once (their groups rendezvous with each other)."""
    errors: list[BaseException] = []

    def run(t: Trainer) -> None:
        try:
            fn(t)  # type: ignore[operator]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in trainers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors


def test_retired_groups_close_at_the_next_generations_first_commit(tmp_path: Path) -> None:
    plan = even_plan(num_layers=6, nodes=[0, 1], num_pipelines=2, global_microbatches=2, microbatch_size=1)
    spec = JobSpec(model="tiny", plan=plan, steps=4, run_dir=str(tmp_path), optim=OPTIM, device="cpu",
                   collective_timeout_s=GROUP_TIMEOUT_S)
    store = dist.HashStore()
    trainers = [Trainer(spec, node=n, local_rank=0) for n in range(2)]

    def join(g: int, step: int) -> object:
        return lambda t: t.start(plan=plan, generation=g, store=store, abort=None, fetch=None, step=step)

    _both(join(1, 0), trainers)
    _both(lambda t: t.train(1), trainers)
    old_world = trainers[0].groups.world
    # Rank 0 posts an all-reduce rank 1 never joins and abandons it, as an aborted step does.
    work = old_world.all_reduce(torch.zeros(4))
    ended: list[tuple[float, str]] = []

    def abandoned_wait() -> None:
        try:
            work.wait()
            ended.append((time.monotonic(), "completed"))
        except RuntimeError as exc:
            ended.append((time.monotonic(), str(exc)))

    waiter = threading.Thread(target=abandoned_wait, daemon=True)
    waiter.start()
    _both(join(2, 1), trainers)
    time.sleep(1.0)
    assert waiter.is_alive(), "a retired group was closed before the next generation committed a step"
    committed_at = time.monotonic()
    _both(lambda t: t.train(2), trainers)  # up to 2 steps committed: step 1, generation 2's first
    waiter.join(10.0)
    assert not waiter.is_alive(), "the abandoned operation still waits after the next generation's commit"
    at, error = ended[0]
    assert at - committed_at < 10.0 < GROUP_TIMEOUT_S
    # Closed here ("closure"/"closed"), or by the peer first, whose close resets the pair.
    assert "closure" in error or "closed" in error.lower() or "reset by peer" in error.lower(), error
    # The retired world group is closed: an operation on it fails at once instead of waiting.
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        old_world.all_reduce(torch.zeros(1)).wait()
    assert time.monotonic() - t0 < 5.0
    # The current generation is untouched.
    _both(lambda t: t.train(3), trainers)
    assert [t.step for t in trainers] == [3, 3]
    for t in trainers:
        t.shutdown()


def test_a_workers_threads_do_not_grow_with_generations(tmp_path: Path) -> None:
    """Five generations of the same two trainers, each joined and trained a step: once a
    generation's first commit has closed the groups left behind, they are let go (the graveyard
    keeps a group only until it is closed), so gloo's threads are those of the current generation
    alone. Before, every left group was kept: three threads a group a generation, for good."""
    plan = even_plan(num_layers=6, nodes=[0, 1], num_pipelines=2, global_microbatches=2, microbatch_size=1)
    spec = JobSpec(model="tiny", plan=plan, steps=10, run_dir=str(tmp_path), optim=OPTIM, device="cpu",
                   collective_timeout_s=GROUP_TIMEOUT_S)
    store = dist.HashStore()
    trainers = [Trainer(spec, node=n, local_rank=0) for n in range(2)]
    baseline = left_behind(Counter(), within_s=5.0, kinds=("gloo_tcp_loop",))  # the test before's, gone
    counts = []
    try:
        for g in range(1, 6):
            _both(lambda t, g=g: t.start(plan=plan, generation=g, store=store, abort=None, fetch=None,  # type: ignore[misc]
                                         step=g - 1), trainers)
            _both(lambda t, g=g: t.train(g), trainers)  # type: ignore[misc]
            current = sum(len(t.groups.created) for t in trainers)  # this generation's groups, both workers
            deadline = time.monotonic() + 5.0  # the closing thread lets them go (0.5 s here)
            while (loops := generation_threads()["gloo_tcp_loop"] - baseline["gloo_tcp_loop"]) > current:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            counts.append(loops)  # at most: the test before's may end during this one
            assert loops <= current, f"generation {g}: {current} groups open, TCP loops by generation {counts}"
    finally:
        for t in trainers:
            t.shutdown()
