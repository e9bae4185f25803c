"""Elastic runs of `tiny` on real processes (etcd, agents, workers) and what they are compared with."""

from __future__ import annotations

from pathlib import Path

import torch

from elastic.runtime.injection import parse_injection
from elastic.runtime.job import JobSpec
from elastic.runtime.launcher import launch_elastic
from elastic.runtime.optim import OptimConfig
from elastic.runtime.planning import ClusterSpec
from elastic.runtime.protocol import ElasticConfig
from elastic.runtime.summary import RunSummary, load_final_state
from templates.plan import even_plan

STEPS = 20
OPTIM = OptimConfig(lr=1e-3, warmup_steps=2, eps=1e-6)  # eps: see tests/engine/runs.py
TOLERANCE = 1e-5


def run_elastic(
    run_dir: Path,
    *,
    nodes: int,
    pipelines: int,
    fault_tolerance: int = 1,
    inject: tuple[str, ...] = (),
    checkpoint_every: int = 5,
    steps: int = STEPS,
    timeout_s: float = 150.0,
) -> tuple[RunSummary, dict[str, torch.Tensor]]:
    """Train tiny on `nodes` nodes dealt into `pipelines` multi-stage pipelines, with faults."""
    plan = even_plan(num_layers=6, nodes=list(range(nodes)), num_pipelines=pipelines, global_microbatches=4,
                     microbatch_size=2, fault_tolerance=fault_tolerance)  # fmt: skip
    spec = JobSpec(model="tiny", plan=plan, steps=steps, run_dir=str(run_dir), optim=OPTIM, device="cpu",
                   collective_timeout_s=60.0)  # fmt: skip
    cluster = ClusterSpec(
        model="tiny", nodes=nodes, fault_tolerance=fault_tolerance, global_batch=8, microbatch=2
    )
    config = ElasticConfig(spec=spec, cluster=cluster, injections=tuple(parse_injection(i) for i in inject),
                           checkpoint_every=checkpoint_every)  # fmt: skip
    summary = launch_elastic(config, quiet=True, timeout_s=timeout_s)
    return summary, load_final_state(spec)


def max_rel_diff(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest, over parameters, of max|state - reference| / max|reference|."""
    assert state.keys() == reference.keys()
    worst = 0.0
    for name, ref in reference.items():
        assert state[name].shape == ref.shape, name
        worst = max(worst, float((state[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)))
    return worst


def check_same_training(
    summary: RunSummary,
    state: dict[str, torch.Tensor],
    reference: tuple[RunSummary, dict[str, torch.Tensor]],
    *,
    steps: int = STEPS,
) -> None:
    """The run committed every step, its losses and final parameters match the failure-free run,
    and no survivor's worker was restarted (each worker of a node incarnation registered one PID)."""
    ref_summary, ref_state = reference
    assert summary.steps_committed == steps
    assert len(summary.losses) == steps
    for step, (got, want) in enumerate(zip(summary.losses, ref_summary.losses, strict=True)):
        assert abs(got - want) <= TOLERANCE * abs(want), f"step {step + 1}: loss {got} vs failure-free {want}"
    diff = max_rel_diff(state, ref_state)
    assert diff <= TOLERANCE, f"final state differs from the failure-free run by {diff:.2e}"
    assert summary.worker_restarts == 0
    assert all(len(pids) == 1 for pids in summary.worker_pids.values()), summary.worker_pids
