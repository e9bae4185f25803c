"""A step is a transaction: a failed step leaves parameters, optimizer state and the step
counter exactly as they were, and replaying it gives the run that never failed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic.engine.step import StepDiscarded
from elastic.engine.trainer import Trainer
from elastic.records.job import JobSpec
from tests.engine.plans import single
from tests.engine.runs import OPTIM

pytestmark = pytest.mark.timeout(120)


def snapshot(trainer: Trainer) -> dict[str, Any]:
    params = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
    moments = {
        n: (s.exp_avg.clone(), s.exp_avg_sq.clone(), s.step) for n, s in trainer.optimizer.state.items()
    }
    return {"params": params, "moments": moments, "step": trainer.step}


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["step"] == b["step"]
    for name, t in a["params"].items():
        assert torch.equal(t, b["params"][name]), name
    for name, (m, v, k) in a["moments"].items():
        m2, v2, k2 = b["moments"][name]
        assert torch.equal(m, m2) and torch.equal(v, v2) and k == k2, name


@pytest.fixture
def make_trainer(tmp_path: Path) -> Iterator[Any]:
    """A one-worker gloo world in this process (a new store and world per trainer)."""
    made: list[Trainer] = []

    def make() -> Trainer:
        spec = JobSpec(
            model="tiny",
            plan=single(microbatches=4),
            steps=2,
            run_dir=str(tmp_path),
            optim=OPTIM,
            device="cpu",
        )
        trainer = Trainer(spec, node=0, local_rank=0)
        trainer.start(plan=spec.plan, generation=0, store=dist.HashStore(), abort=None, fetch=None, step=0)
        made.append(trainer)
        return trainer

    yield make
    for trainer in made:
        trainer.shutdown()
    made.clear()  # a world of one has no connection to close: its gloo threads end with the group


def test_failed_steps_change_nothing_and_replay_matches(make_trainer: Any) -> None:
    trainer = make_trainer()
    trainer.train(1)
    before = snapshot(trainer)

    # A microbatch that blows up mid-schedule (as a dead peer would make a transfer fail).
    calls = {"n": 0}

    def explode(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure in microbatch 2")

    handle = trainer.module.register_forward_hook(explode)
    with pytest.raises(StepDiscarded, match="step 1 discarded"):
        trainer.train(2)
    handle.remove()
    assert_same(snapshot(trainer), before)

    # A non-finite loss anywhere: every worker agrees to discard.
    handle = trainer.module.register_forward_hook(lambda m, a, out: out * float("nan"))
    with pytest.raises(StepDiscarded, match="gradient norm"):
        trainer.train(2)
    handle.remove()
    assert_same(snapshot(trainer), before)
    assert all(p.grad is None for p in trainer.module.parameters())

    replayed = trainer.train(2)
    after_replay = snapshot(trainer)
    trainer.close()

    clean = make_trainer()
    reports = clean.train(2)
    assert_same(snapshot(clean), after_replay)
    assert reports[1].loss == replayed[0].loss
    clean.close()
