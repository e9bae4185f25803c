"""Joining a generation without initialising: a stage built from fetched shards (on the meta
device, then filled) or from kept ones is bit-identical to the state it came from, and trains
on exactly as the worker that never moved."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic.engine.trainer import Trainer
from elastic.records.job import JobSpec
from tests.engine.plans import single
from tests.engine.runs import OPTIM
from tests.engine.test_transaction import assert_same, snapshot

pytestmark = pytest.mark.timeout(120)


def started(spec: JobSpec) -> Trainer:
    trainer = Trainer(spec, node=0, local_rank=0)
    trainer.start(plan=spec.plan, generation=1, store=dist.HashStore(), abort=None, fetch=None, step=0)
    return trainer


@pytest.fixture
def spec(tmp_path: Path) -> JobSpec:
    return JobSpec(model="tiny", plan=single(microbatches=4), steps=6, run_dir=str(tmp_path), optim=OPTIM,
                   device="cpu")


def test_stage_built_from_fetched_shards_is_bit_identical_and_trains_on_alike(spec: JobSpec) -> None:
    source = started(spec)
    source.train(2)
    fetched_keys: list[tuple[int, int]] = []

    def fetch(keys: list[tuple[int, int]]) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
        fetched_keys.extend(keys)
        return {k: source.export_shard(*k) for k in keys}

    joined = Trainer(spec, node=0, local_rank=0)
    joined.start(plan=spec.plan, generation=2, store=dist.HashStore(), abort=None, fetch=fetch, step=2)
    assert sorted(fetched_keys) == source.holdings()
    assert_same(snapshot(joined), snapshot(source))
    for name, p in joined.module.named_parameters():
        assert p.device.type == "cpu" and p.is_leaf and p.requires_grad, name
        assert p.tp_dim == dict(source.module.named_parameters())[name].tp_dim, name  # type: ignore[attr-defined]
    # Buffers too (the stage has none today; any added later must come out right).
    assert {n: b for n, b in joined.module.named_buffers()}.keys() == {n for n, _ in source.module.named_buffers()}
    source.train(5)
    joined.train(5)
    assert_same(snapshot(joined), snapshot(source))


def test_kept_shards_stay_the_same_tensors(spec: JobSpec) -> None:
    trainer = started(spec)
    trainer.train(2)
    before = {n: p for n, p in trainer.module.named_parameters()}
    moments = {n: s.exp_avg for n, s in trainer.optimizer.state.items()}
    trainer.start(plan=spec.plan, generation=2, store=dist.HashStore(), abort=None, fetch=None, step=2)
    for name, p in trainer.module.named_parameters():
        assert p is before[name] and trainer.optimizer.state[name].exp_avg is moments[name], name
    trainer.train(5)
    reference = started(spec)
    reference.train(5)
    assert_same(snapshot(trainer), snapshot(reference))
