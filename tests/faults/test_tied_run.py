"""Tied embeddings (`tie_embeddings`, issue 58; elastic/parallel/tied.py) on real processes.

- One worker training `llama-tiny` tied is plain PyTorch's training of the same model with one
  shared `nn.Parameter` for the embedding and the head (autograd sums both uses; one AdamW
  state; torch's `clip_grad_norm_` counts it once): the losses and the final parameters to 1e-5,
  and the runtime's two copies end bit for bit equal.
- 4 nodes in 2 pipelines of 2 stages (the embedding and the head on different workers, so their
  gradients cross the pipeline point to point), node 3 SIGKILLed at step 5 and recovered without
  restart: bit for bit the one-worker run (the tied sum is the same bits on every plan).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from elastic.data.dataset import TokenDataset, step_sample_indices
from elastic.engine.optim import lr_at
from elastic.model.config import get_preset
from elastic.model.gpt import GPTStage
from elastic.records.config import ElasticConfig
from elastic.records.injection import parse_injection
from elastic.records.job import JobSpec
from elastic.records.summary import RunSummary, load_final_state
from elastic.roles.launcher import launch_elastic
from templates.plan import even_plan
from tests.faults.runs import OPTIM, Result, max_rel_diff, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CFG = get_preset("llama-tiny").with_overrides(tie_embeddings=True)
STEPS = 8
MICROBATCHES, MBS = 4, 2


def _plain_pytorch(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: one module whose head uses the embedding's own parameter."""
    model = GPTStage(CFG).train()
    model.head.lm_head.weight = model.embed.wte.weight  # type: ignore[union-attr]
    params = dict(model.named_parameters())  # the shared matrix once, as embed.wte.weight
    assert "head.lm_head.weight" not in params
    opt = torch.optim.AdamW([{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": OPTIM.weight_decay},
                             {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}],
                            lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps, foreach=False)
    data = TokenDataset(seq_len=CFG.seq_len)
    losses = []
    for step in range(steps):
        samples = list(step_sample_indices(step, MICROBATCHES * MBS))
        total = 0.0
        for m in range(MICROBATCHES):
            tokens, targets = data.batch(samples[m * MBS : (m + 1) * MBS])
            loss = model.loss(model(tokens, dropout_key=0), targets) / MICROBATCHES
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(list(params.values()), OPTIM.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, OPTIM)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    state = {n: p.detach().clone() for n, p in params.items()}
    state["head.lm_head.weight"] = state["embed.wte.weight"]
    return losses, state


def _one_worker(run_dir: Path) -> Result:
    from elastic.roles.static_launcher import launch

    plan = even_plan(num_layers=CFG.num_layers, nodes=[0], num_pipelines=1, global_microbatches=MICROBATCHES,
                     microbatch_size=MBS, fault_tolerance=0)
    spec = JobSpec(model="llama-tiny", shape=CFG, plan=plan, steps=STEPS, run_dir=str(run_dir), optim=OPTIM,
                   device="cpu")
    return launch(spec, quiet=True, timeout_s=240), load_final_state(spec)


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory: pytest.TempPathFactory) -> Result:
    return _one_worker(tmp_path_factory.mktemp("tied-static"))


def test_one_worker_trains_as_plain_pytorch_with_one_parameter(one_worker: Result) -> None:
    summary, state = one_worker
    want_losses, want = _plain_pytorch(STEPS)
    for step, (got, expected) in enumerate(zip(summary.losses, want_losses, strict=True)):
        assert abs(got - expected) <= 1e-5 * abs(expected), (step + 1, got, expected)
    assert torch.equal(state["head.lm_head.weight"], state["embed.wte.weight"])
    assert max_rel_diff(state, want) <= 1e-5, max_rel_diff(state, want)
    assert summary.losses[-1] < summary.losses[0] - 0.3, summary.losses  # it trains


def test_two_stages_through_a_failure_are_the_one_worker_run(one_worker: Result, tmp_path: Path) -> None:
    config = tiny_config(tmp_path, nodes=4, pipelines=2, steps=STEPS, checkpoint_every=0,
                         global_microbatches=MICROBATCHES)
    spec = dataclasses.replace(config.spec, model="llama-tiny", shape=CFG)
    assert all(len(p.stages) == 2 for p in spec.plan.pipelines)
    config = ElasticConfig(**{**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)},
                              "spec": spec, "cluster": dataclasses.replace(config.cluster, model="llama-tiny", shape=CFG),
                              "injections": (parse_injection("kill:node=3,step=5"),)})
    summary: RunSummary = launch_elastic(config, quiet=True, timeout_s=240)
    state = load_final_state(spec)
    assert summary.steps_committed == STEPS and [r["lost_nodes"] for r in summary.recoveries] == [[3]]
    assert summary.worker_restarts == 0
    assert summary.losses == one_worker[0].losses
    assert all(torch.equal(state[n], one_worker[1][n]) for n in state), [
        n for n in state if not torch.equal(state[n], one_worker[1][n])]
