"""AdamW against torch's reference implementation; the LR schedule; exact gradient sums."""

from __future__ import annotations

import math

import pytest
import torch

from elastic.engine import adamw
from elastic.engine.adamw import ParamState
from elastic.engine.optim import OptimConfig, build_optimizer, lr_at

pytestmark = pytest.mark.timeout(60)


def test_lr_warms_up_linearly_then_decays_by_cosine() -> None:
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=14)
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg) == 1.0
    assert lr_at(9, cfg) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 2)))
    assert lr_at(14, cfg) == 0.1 and lr_at(100, cfg) == 0.1
    values = [lr_at(s, cfg) for s in range(4, 15)]
    assert values == sorted(values, reverse=True)


def test_bad_optimizer_settings() -> None:
    with pytest.raises(ValueError, match="min_lr"):
        OptimConfig(lr=1e-3, min_lr=1e-2)
    with pytest.raises(ValueError, match="warmup_steps"):
        OptimConfig(warmup_steps=10, decay_steps=5)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-kernel", "tensor-ops"])
def test_adamw_matches_torch_adamw(fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not fused:  # the form a device without torch's fused kernel runs
        monkeypatch.setattr(adamw, "FUSED_DEVICES", ())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    reference = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    cfg = OptimConfig(weight_decay=0.1)
    ours = build_optimizer(model, cfg)
    names = [n for n, _ in model.named_parameters()]
    by_name = dict(zip(names, reference, strict=True))
    decay = [by_name[n] for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [by_name[n] for n, p in model.named_parameters() if p.dim() < 2]
    theirs = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1.0, betas=cfg.betas, eps=cfg.eps, foreach=False,
    )
    for step in range(6):
        lr = lr_at(step, cfg)
        ours.lr = lr
        for group in theirs.param_groups:
            group["lr"] = lr
        for p, q in zip(model.parameters(), reference, strict=True):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for p, q in zip(model.parameters(), reference, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


def test_parameters_at_different_step_counts_get_their_own_bias_correction(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adopted state may be at another step count than the rest (a layer fetched from a peer):
    the fused kernel is called per step count and matches the per-operation form."""
    torch.manual_seed(2)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    grads = [[torch.randn_like(p) for p in models[0].parameters()] for _ in range(3)]

    def run(model: torch.nn.Module) -> dict[str, ParamState]:
        state = {"0.weight": ParamState(exp_avg=torch.full((16, 8), 0.1), exp_avg_sq=torch.full((16, 8), 0.02), step=7)}
        opt = build_optimizer(model, OptimConfig(weight_decay=0.1), state=state)
        opt.lr = 1e-2
        for step_grads in grads:
            for p, g in zip(model.parameters(), step_grads, strict=True):
                p.grad = g.clone()
            opt.step()
        return opt.state

    fused = run(models[0])
    monkeypatch.setattr(adamw, "FUSED_DEVICES", ())
    ops = run(models[1])
    assert {n: st.step for n, st in fused.items()} == {n: st.step for n, st in ops.items()} == {
        "0.weight": 10, "0.bias": 3, "1.weight": 3, "1.bias": 3}
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


def test_a_missing_gradient_fails_the_step_before_anything_changes() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    opt.lr = 1e-2
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.grad = None if name == "1.bias" else torch.ones_like(p)
    with pytest.raises(RuntimeError, match=r"parameter 1\.bias has no gradient"):
        opt.step()
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    assert all(st.step == 0 for st in opt.state.values())


def test_master_weights_must_be_fp32() -> None:
    with pytest.raises(ValueError, match="float32"):
        build_optimizer(torch.nn.Linear(2, 2).to(torch.bfloat16), OptimConfig())
