"""The static reference loop: one worker of a job trained in one generation, with no control
plane (`elastic run --static`'s workers, elastic/roles/worker.py): steps are prepared and
committed back to back, then the outputs are written. What the elastic runs are compared with."""

from __future__ import annotations

import json
import time

import torch

from elastic.engine.trainer import Trainer
from elastic.records.job import JobSpec
from elastic.records.progress import StepResult


def run_worker(spec: JobSpec, *, node: int, local_rank: int, store: torch.distributed.Store) -> None:
    """Train `spec` as worker `local_rank` of `node` (one generation, no control plane)."""
    torch.set_num_threads(spec.threads_per_worker)
    trainer = Trainer(spec, node=node, local_rank=local_rank)
    trainer.start(plan=spec.plan, generation=spec.generation, store=store, abort=None, fetch=None, step=0)
    seq_tokens = spec.plan.global_batch * spec.model_config.seq_len

    def progress(r: StepResult) -> None:
        if trainer.layout.rank == 0:
            print(
                f"step {r.step + 1}/{spec.steps}  loss {r.loss:.4f}  grad_norm {r.grad_norm:.3f}  "
                f"lr {r.lr:.2e}  {r.seconds * 1000:.0f} ms  {seq_tokens / r.seconds:.0f} tok/s",
                flush=True,
            )

    def on_eval(committed: int, loss: float) -> None:
        if trainer.layout.rank == 0:
            print(f"eval after step {committed}/{spec.steps}  val_loss {loss:.4f}  "
                  f"({spec.eval_batches} held-out batches)", flush=True)

    start = time.perf_counter()
    reports = trainer.train(spec.steps, on_step=progress, on_eval=on_eval)
    train_seconds = time.perf_counter() - start
    save_outputs(trainer, reports, train_seconds)
    trainer.close()


def save_outputs(trainer: Trainer, reports: list[StepResult], train_seconds: float) -> None:
    """Pipeline 0's stages write their full parameters; rank 0 writes the step results."""
    state = trainer.full_state()
    layout = trainer.layout
    if layout.pipeline == 0 and layout.tp_rank == 0:
        path = trainer.spec.stage_state_path(layout.stage)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
    if layout.rank == 0:
        result = {
            "steps_committed": trainer.step,
            "losses": [r.loss for r in reports],
            "grad_norms": [r.grad_norm for r in reports],
            "lrs": [r.lr for r in reports],
            "step_seconds": [r.seconds for r in reports],
            "step_committed_at": [r.committed_at for r in reports],
            "train_seconds": train_seconds,
            "eval_losses": [[step, loss] for step, loss in trainer.evals],
        }
        trainer.spec.result_path.write_text(json.dumps(result, indent=1))
