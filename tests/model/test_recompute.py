"""Activation recomputation (model/gpt.py `recompute`): the loss and every gradient of `selective`
and `full` equal those of `none` bit for bit (the recomputed forward draws the same dropout
masks), with and without dropout, at tensor-parallel degree 1 and 2 (ranks as threads over real
gloo communicators); evaluation is the same forward; a bad mode is refused."""

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


def _step(cfg: GPTConfig, tp: TensorParallel, mode: str) -> dict[str, torch.Tensor]:
    """One forward and backward of the whole model: its loss and every gradient, by name."""
    stage = GPTStage(cfg, tp=tp, recompute=mode)
    stage.train()
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    loss = stage.loss(stage(tokens, dropout_key=11), targets)
    loss.backward()
    out = {"loss": loss.detach()}
    out.update({name: p.grad for name, p in stage.named_parameters() if p.grad is not None})
    return out


def _run(cfg: GPTConfig, degree: int, mode: str) -> list[dict[str, torch.Tensor]]:
    if degree == 1:
        return [_step(cfg, TensorParallel.single(), mode)]
    comms = gloo_comms(degree, name=f"tp-{mode}")
    results = on_threads(degree, lambda r: _step(cfg, TensorParallel(group=comms[r], rank=r, size=degree), mode))
    for c in comms:
        c.shutdown()
    assert not any(isinstance(r, BaseException) for r in results), results
    return results


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("degree", [1, 2])
def test_recomputation_gives_the_same_gradients_bit_for_bit(degree: int, dropout: float) -> None:
    cfg = dataclasses.replace(CFG, dropout=dropout)
    reference = _run(cfg, degree, "none")
    for mode in ("selective", "full"):
        got = _run(cfg, degree, mode)
        for rank, (want, have) in enumerate(zip(reference, got, strict=True)):
            assert want.keys() == have.keys()
            differ = [name for name in want if not torch.equal(want[name], have[name])]
            assert not differ, f"{mode}, TP {degree} rank {rank}: differ from none in {differ}"


def test_evaluation_is_the_same_forward_in_every_mode() -> None:
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(3))
    outs = []
    for mode in RECOMPUTE_MODES:
        stage = GPTStage(CFG, recompute=mode).eval()
        with torch.no_grad():
            outs.append(stage(tokens, dropout_key=0))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_a_bad_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="recompute mode is one of none, selective, full"):
        GPTStage(CFG, recompute="some")
