"""Run a plan on real worker processes and compare final parameters."""

from __future__ import annotations

from pathlib import Path

import torch

from elastic.engine.optim import OptimConfig
from elastic.records.job import JobSpec
from elastic.records.summary import RunSummary, load_final_state
from elastic.roles.static_launcher import launch
from templates.plan import Plan

STEPS = 5
# AdamW divides by sqrt(v) + eps: on elements whose gradient nearly cancels over the batch it
# turns last-bit differences of that gradient into update differences of up to lr * dg / eps.
# Tensor parallelism changes the forward's summation order (row-parallel all-reduce), so its
# gradients differ from the unsharded ones in the last bits; eps = 1e-6 bounds that
# amplification below the 1e-5 tolerance (with eps = 1e-8 the TP case differs by ~1e-4,
# mostly in the attention key bias, whose true gradient is exactly zero).
OPTIM = OptimConfig(lr=1e-3, warmup_steps=2, eps=1e-6)


def run_plan(plan: Plan, run_dir: Path, *, steps: int = STEPS) -> tuple[RunSummary, dict[str, torch.Tensor]]:
    spec = JobSpec(model="tiny", plan=plan, steps=steps, run_dir=str(run_dir), optim=OPTIM, device="cpu")
    summary = launch(spec, quiet=True, timeout_s=170)
    return summary, load_final_state(spec)


def max_rel_diff(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest, over parameters, of max|state - reference| / max|reference|."""
    assert state.keys() == reference.keys()
    worst = 0.0
    for name, ref in reference.items():
        assert state[name].shape == ref.shape and state[name].dtype == torch.float32, name
        worst = max(worst, float((state[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)))
    return worst
