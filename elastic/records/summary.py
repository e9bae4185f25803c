"""What a finished run produced: per-step results and the merged final parameters."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic.coordinator.jsonrecord import to_data

if TYPE_CHECKING:  # torch takes seconds to import; `elastic status` reads summaries without it
    import torch

    from elastic.records.job import JobSpec


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """Results of a run, as written to `elastic run --summary`."""

    steps_committed: int
    """Optimizer steps committed."""
    losses: list[float]
    """Mean global-batch loss of each committed step."""
    tokens_per_s: float
    """Training tokens per second over all committed steps (setup excluded)."""
    steady_step_s: float
    """Median step time excluding the first step (the first step when there is only one)."""
    step_seconds: list[float]
    """Wall time of each committed step on rank 0."""
    grad_norms: list[float]
    """Global gradient norm (before clipping) of each committed step."""
    global_batch: int
    """Samples per step."""
    seq_len: int
    """Tokens per sample."""
    world_size: int
    """Worker processes of the run."""
    pipelines: int
    """Pipelines of the plan (of the last generation in an elastic run)."""
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    """Elastic runs: one entry per reconfiguration (generation, lost and joined nodes, seconds
    detecting, planning, transferring, rebuilding (groups and stage) and replaying, total, bytes moved, and
    the wall times `detected_at`, `published_at`, `fault_at`, `first_commit_at`)."""
    worker_restarts: int = 0
    """Elastic runs: extra PIDs registered by a worker of the same node incarnation (must be 0)."""
    startup_s: float = 0.0
    """Elastic runs: seconds from the launcher's start (etcd, agents, workers) to the first commit."""
    worker_pids: dict[str, list[int]] = field(default_factory=dict)
    """Elastic runs: "node/local_rank/incarnation" -> the PIDs it registered."""
    step_committed_at: list[float] = field(default_factory=list)
    """Wall time (Unix seconds) at which each committed step was committed (on rank 0 in a
    static run, on the progress writer in an elastic one)."""
    step_generations: list[int] = field(default_factory=list)
    """Elastic runs: the generation that committed each step."""
    started_at: float = 0.0
    """Elastic runs: wall time (Unix seconds) at which the launcher started."""
    eval_losses: list[list[float]] = field(default_factory=list)
    """Runs with `--eval-every`: [[step, validation loss], ...], one entry per evaluation, where
    `step` is the number of steps committed when it ran (elastic/engine/eval.py)."""
    model: dict[str, Any] = field(default_factory=dict)
    """The model's shape (GPTConfig fields: vocab_size, seq_len, n_layer, n_head, d_model, dropout,
    init_seed) and its parameter count (`num_params`)."""
    first_step: int = 0
    """Index (0-based) of the first step this run committed: the step it resumed from, else 0;
    `losses[i]` is the loss of step `first_step + i` (printed as step first_step + i + 1)."""
    resumed_from: dict[str, Any] | None = None
    """`elastic run --resume`: the earlier run's checkpoint this run started from: `run_dir`,
    `checkpoint_dir`, `step`, `tp_degree` (the degree it was written at), `skipped` (newer
    checkpoints that were incomplete or corrupt: `step`, `why`) and `text` ("resumed from step N
    of RUN_DIR", with the skipped ones). None for a run that started from the seed."""
    init_from: str | None = None
    """`elastic run --init-from DIR`: the Hugging Face checkpoint its weights started from (None:
    from the seed, or from a checkpoint of this runtime with `--resume`)."""

    # Not a JsonRecord: summary.json is the run's output (`elastic run --summary`), read as a
    # plain object by `elastic report` and people, and never read back into this type; it
    # carries no schema version.
    def to_dict(self) -> dict[str, Any]:
        return to_data(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


def collect_summary(spec: JobSpec) -> RunSummary:
    """Read rank 0's result file of a finished run of `spec`."""
    result = json.loads(spec.result_path.read_text())
    steps: list[float] = result["step_seconds"]
    tokens = spec.plan.global_batch * spec.model_config.seq_len
    steady = steps[1:] or steps
    return RunSummary(
        steps_committed=int(result["steps_committed"]),
        losses=[float(x) for x in result["losses"]],
        tokens_per_s=tokens * len(steps) / result["train_seconds"] if steps else 0.0,
        steady_step_s=statistics.median(steady) if steady else 0.0,
        step_seconds=steps,
        grad_norms=[float(x) for x in result["grad_norms"]],
        global_batch=spec.plan.global_batch,
        seq_len=spec.model_config.seq_len,
        world_size=spec.world_size,
        pipelines=len(spec.plan.pipelines),
        step_committed_at=[float(x) for x in result.get("step_committed_at", [])],
        eval_losses=[[int(step), float(loss)] for step, loss in result.get("eval_losses", [])],
        model=model_fields(spec),
        init_from=spec.init_from,
    )


def model_fields(spec: JobSpec) -> dict[str, Any]:
    """The summary's `model`: the job's shape and its parameter count."""
    cfg = spec.model_config
    return {**cfg.as_dict(), "num_params": cfg.num_params()}


def load_final_state(spec: JobSpec) -> dict[str, torch.Tensor]:
    """Merge pipeline 0's per-stage full states into one canonical name -> fp32 tensor dict.

    An elastic run's last generation may have another plan: its pipeline 0 wrote final_plan.json.
    """
    import torch

    from templates.plan import Plan

    final_plan = Path(spec.run_dir) / "final_plan.json"
    plan = Plan.from_json(final_plan.read_text()) if final_plan.exists() else spec.plan
    state: dict[str, torch.Tensor] = {}
    for s in range(len(plan.pipelines[0].stages)):
        part = torch.load(spec.stage_state_path(s), map_location="cpu", weights_only=True)
        state.update(part)
    return state
