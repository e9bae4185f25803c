"""Sharded vs unsharded: the TP model's loss and every gathered gradient equal the plain model's."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from tests.model import tp_worker
from tests.model.reference import assert_close, max_rel_diff
from tests.processes import run_processes

pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow
@pytest.mark.parametrize("degree", [1, 2, 4])
def test_tensor_parallel_matches_unsharded_reference(degree: int, tmp_path: Path) -> None:
    out = tmp_path / "result"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=tp_worker.main, args=(r, degree, str(tmp_path / "init"), str(out)), daemon=True)
        for r in range(degree)
    ]
    run_processes(procs, timeout=240)

    from elastic.model import TensorParallel

    single = TensorParallel.single()
    # "two_stages" ran the TP model as stages [0, 3) + [3, end); its reference is the whole model.
    for case, overrides in (("plain", {}), ("dropout", {"dropout": 0.1}), ("two_stages", {})):
        ref = tp_worker.run_case(overrides, single, None)  # whole unsharded model: the reference
        for rank in range(degree):
            got = torch.load(f"{out}.{rank}")[case]
            # Every rank reports the same loss, equal to the reference's.
            assert max_rel_diff(got["loss"], ref["loss"]) <= 1e-5, (case, rank)
            assert got["grads"].keys() == ref["grads"].keys()
            # TP-independent initialisation: gathered shards are the reference's parameters, bit for bit.
            for name, full in ref["params"].items():
                assert torch.equal(got["params"][name], full), (case, name)
            for name, grad in ref["grads"].items():
                assert_close(got["grads"][name], grad, 1e-5, f"{case} rank {rank} grad {name}")
