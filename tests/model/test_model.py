"""Single-process model tests: stages vs the whole model, loss vs torch's cross-entropy, presets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from elastic.data import TokenDataset
from elastic.model import PRESETS, GPTStage, TensorParallel, get_preset
from elastic.model.collectives import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp
from elastic.model.naming import layer_of
from tests.model.reference import assert_close

pytestmark = pytest.mark.timeout(120)

CFG = get_preset("tiny")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return TokenDataset(seq_len=CFG.seq_len).batch(range(3))


def _loss_and_grads(stages: list[GPTStage]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    inputs, targets = _batch()
    x = inputs
    for stage in stages:
        x = stage(x)
    loss = stages[-1].loss(x, targets)
    loss.backward()
    grads = {n: p.grad.clone() for s in stages for n, p in s.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.slow
@pytest.mark.parametrize("bounds", [(3,), (1,), (5,), (1, 2, 4), (2, 3, 4, 5)])
def test_consecutive_stages_equal_whole_model(bounds: tuple[int, ...]) -> None:
    ref_loss, ref_grads = _loss_and_grads([GPTStage(CFG)])
    edges = [0, *bounds, CFG.num_layers]
    stages = [GPTStage(CFG, first=a, last=b) for a, b in zip(edges, edges[1:], strict=False)]
    loss, grads = _loss_and_grads(stages)
    assert_close(loss, ref_loss, 1e-6, "loss")
    assert grads.keys() == ref_grads.keys()  # canonical names whatever the split
    for name, grad in ref_grads.items():
        assert_close(grads[name], grad, 1e-5, name)


def test_loss_equals_torch_cross_entropy_on_full_logits() -> None:
    model = GPTStage(CFG)
    inputs, targets = _batch()
    logits = model(inputs)
    ours = model.loss(logits, targets)
    ref = F.cross_entropy(logits.reshape(-1, CFG.vocab_size), targets.reshape(-1))
    assert_close(ours, ref, 1e-6, "loss")
    (g_ours,) = torch.autograd.grad(ours, logits, retain_graph=True)
    (g_ref,) = torch.autograd.grad(ref, logits)
    assert_close(g_ours, g_ref, 1e-6, "d loss / d logits")


def test_a_float64_model_computes_its_loss_in_float64() -> None:
    """Row 10 of issue 31: the loss used to be computed in float32 whatever the model's dtype, so a
    float64 run carried float32 error. Reference: torch's cross-entropy on the same float64 logits."""
    model = GPTStage(CFG).double()
    inputs, targets = _batch()
    logits = model(inputs)
    assert logits.dtype == torch.float64
    ours = model.loss(logits, targets)
    assert ours.dtype == torch.float64
    ref = F.cross_entropy(logits.reshape(-1, CFG.vocab_size), targets.reshape(-1))
    assert abs(ours.item() - ref.item()) <= 1e-12 * abs(ref.item())
    narrow = F.cross_entropy(logits.float().reshape(-1, CFG.vocab_size), targets.reshape(-1))
    assert abs(narrow.item() - ref.item()) > 1e-10 * abs(ref.item()), "float32 would be caught: the test can fail"
    (g_ours,) = torch.autograd.grad(ours, logits, retain_graph=True)
    (g_ref,) = torch.autograd.grad(ref, logits)
    assert g_ours.dtype == torch.float64 and torch.allclose(g_ours, g_ref, rtol=0, atol=1e-15)


def test_collectives_are_identity_on_a_single_rank() -> None:
    x = torch.randn(2, 3, requires_grad=True)
    single = TensorParallel.single()
    for fn in (copy_to_tp, reduce_from_tp, gather_from_tp, scatter_to_tp):
        assert fn(x, single) is x


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_preset_parameter_count_matches_built_model(name: str) -> None:
    cfg = get_preset(name)
    built = sum(p.numel() for p in GPTStage(cfg).parameters())
    assert built == cfg.num_params()
    per_layer = [sum(p.numel() for p in GPTStage(cfg, first=i, last=i + 1).parameters()) for i in range(cfg.num_layers)]
    assert per_layer == [cfg.layer_param_count(i) for i in range(cfg.num_layers)]


def test_every_canonical_name_maps_to_the_stage_that_holds_it() -> None:
    for i in range(CFG.num_layers):
        for name, _ in GPTStage(CFG, first=i, last=i + 1).named_parameters():
            assert layer_of(name, CFG) == i


def test_presets_exist_and_bad_inputs_are_refused() -> None:
    for name in ("tiny", "small", "gpt2-124m", "gpt3-350m", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b"):
        assert name in PRESETS
    with pytest.raises(ValueError, match="unknown model preset 'nope'.*tiny"):
        get_preset("nope")
    with pytest.raises(ValueError, match="not a non-empty range"):
        GPTStage(CFG, first=3, last=3)
    with pytest.raises(ValueError, match="n_head=4 is not divisible by the tensor-parallel degree 3"):
        GPTStage(CFG, tp=TensorParallel(group=object(), rank=0, size=3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seq_len"):
        GPTStage(CFG)(torch.zeros(1, CFG.seq_len + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="no head"):
        GPTStage(CFG, last=2).loss(torch.zeros(1), torch.zeros(1))
