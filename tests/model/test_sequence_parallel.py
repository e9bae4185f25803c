"""Sequence parallelism (model/gpt.py `sequence_parallel`): at tensor-parallel degree 2 and 4
(ranks as threads over real gloo communicators), the loss and every gradient equal those
without it to 1e-5 (the same function, summed in another order), with and without dropout, in
every recomputation mode (and with recomputation bit for bit the same as without); a stage cut
inside the model passes each rank's sequence shard; evaluation is the same forward."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elastic.model import TensorParallel
from elastic.model.config import RECOMPUTE_MODES, GPTConfig
from elastic.model.gpt import GPTStage
from tests.comm.support import gloo_comms, on_threads

pytestmark = pytest.mark.timeout(120)

CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=3, n_head=4, d_model=64)


def _batch(cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    return tokens, torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)


def _step(cfg: GPTConfig, tp: TensorParallel, *, sp: bool, mode: str = "none", cut: int | None = None,
          train: bool = True) -> dict[str, torch.Tensor]:
    """One forward and backward of the whole model (as two stages when `cut`): its loss and
    every gradient, by name (the full model's names)."""
    tokens, targets = _batch(cfg)
    bounds = [(0, cfg.num_layers)] if cut is None else [(0, cut), (cut, cfg.num_layers)]
    stages = [GPTStage(cfg, first=a, last=b, tp=tp, recompute=mode, sequence_parallel=sp).train(train)
              for a, b in bounds]
    x: torch.Tensor = tokens
    for stage in stages:
        if stage.first > 0:  # what crosses the stage boundary
            want = (2, cfg.seq_len // stage.seq_shards, cfg.d_model)
            assert tuple(x.shape) == want, (tuple(x.shape), want)
        x = stage(x, dropout_key=11)
    if not train:
        return {"logits": x.detach()}
    loss = stages[-1].loss(x, targets)
    loss.backward()
    out = {"loss": loss.detach()}
    out.update({name: p.grad for s in stages for name, p in s.named_parameters() if p.grad is not None})
    return out


def _run(cfg: GPTConfig, degree: int, **kwargs: object) -> list[dict[str, torch.Tensor]]:
    comms = gloo_comms(degree, name=f"sp-{kwargs}")
    results = on_threads(degree, lambda r: _step(cfg, TensorParallel(group=comms[r], rank=r, size=degree),
                                                 **kwargs))  # type: ignore[arg-type]
    for c in comms:
        c.shutdown()
    assert not any(isinstance(r, BaseException) for r in results), results
    return results


def _close(want: list[dict[str, torch.Tensor]], have: list[dict[str, torch.Tensor]], what: str) -> None:
    for rank, (a, b) in enumerate(zip(want, have, strict=True)):
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-5, msg=f"{what} rank {rank}: {name}")


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("degree", [2, 4])
def test_sequence_parallelism_computes_the_same_gradients(degree: int, dropout: float) -> None:
    cfg = dataclasses.replace(CFG, dropout=dropout)
    reference = _run(cfg, degree, sp=False)
    got = _run(cfg, degree, sp=True)
    _close(reference, got, f"TP {degree}, dropout {dropout}")
    # replicated parameters' gradients are the same on every rank (summed over the ranks)
    for name in got[0]:
        if got[0][name].shape == got[1][name].shape and name.endswith(("ln1.weight", "ln_f.bias", "wpe", "proj.bias")):
            assert torch.equal(got[0][name], got[1][name]), name


@pytest.mark.parametrize("mode", RECOMPUTE_MODES[1:])
def test_recomputation_with_sequence_parallelism_is_bit_for_bit_the_same(mode: str) -> None:
    cfg = dataclasses.replace(CFG, dropout=0.1)
    reference = _run(cfg, 2, sp=True)
    for rank, (want, have) in enumerate(zip(reference, _run(cfg, 2, sp=True, mode=mode), strict=True)):
        differ = [name for name in want if not torch.equal(want[name], have[name])]
        assert not differ, f"{mode}, rank {rank}: differ from none in {differ}"


def test_a_stage_boundary_carries_the_ranks_sequence_shard() -> None:
    """Two stages cut after block 2: the boundary activation is (batch, seq / 2, d_model) per
    rank, and the gradients (the boundary's included, per rank) are those of one stage."""
    whole = _run(CFG, 2, sp=True)
    cut = _run(CFG, 2, sp=True, cut=3)
    for rank in range(2):
        for name in whole[rank]:
            torch.testing.assert_close(cut[rank][name], whole[rank][name], rtol=1e-6, atol=1e-6)


def test_evaluation_is_the_same_forward() -> None:
    want = _run(CFG, 2, sp=False, train=False)
    have = _run(CFG, 2, sp=True, train=False)
    _close(want, have, "evaluation")


def test_without_tensor_parallelism_there_is_nothing_to_split() -> None:
    stage = GPTStage(CFG, sequence_parallel=True)
    assert not stage.sequence_parallel and stage.seq_shards == 1


def test_a_sequence_that_does_not_split_is_refused() -> None:
    cfg = dataclasses.replace(CFG, seq_len=30)
    comms = gloo_comms(4, name="sp-refuse")
    try:
        errors = on_threads(4, lambda r: GPTStage(cfg, tp=TensorParallel(group=comms[r], rank=r, size=4),
                                                  sequence_parallel=True, initialise=False))
    finally:
        for c in comms:
            c.shutdown()
    assert all(isinstance(e, ValueError) and "seq_len" in str(e) for e in errors), errors
