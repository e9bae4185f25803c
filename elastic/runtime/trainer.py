"""The training loop of one worker for one generation: build the stage, run steps, save.

`Trainer` owns the process groups, the model stage, its optimizer and the committed step
counter. Everything distributed is reached through the objects it was given (store, layout,
groups); nothing is global, so a later generation can build a new Trainer beside a new layout.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic.data.dataset import TokenDataset
from elastic.model.gpt import GPTStage
from elastic.model.naming import layer_of
from elastic.model.state import full_state_dict
from elastic.parallel.groups import ParallelGroups, build_groups
from elastic.parallel.layout import ParallelLayout
from elastic.runtime.device import backend_for, select_device
from elastic.runtime.job import JobSpec
from elastic.runtime.optim import build_optimizer
from elastic.runtime.step import StepReport, StepTransaction


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Trainer:
    """One worker of a job, joined to its generation's process groups."""

    def __init__(self, spec: JobSpec, *, node: int, local_rank: int, store: dist.Store) -> None:
        self.spec = spec
        t0 = time.perf_counter()
        cfg = spec.model_config
        self.layout = ParallelLayout(
            plan=spec.plan, generation=spec.generation, node=node, local_rank=local_rank
        )
        self.device = select_device(local_rank, want=spec.device)
        timeout = timedelta(seconds=spec.collective_timeout_s)
        # One prefix per generation: groups of different generations never share store keys.
        gen_store = dist.PrefixStore(f"generation/{spec.generation}", store)
        dist.init_process_group(
            backend=backend_for(self.device),
            store=gen_store,
            rank=self.layout.rank,
            world_size=self.layout.world_size,
            timeout=timeout,
        )
        world = dist.group.WORLD
        assert world is not None
        t1 = time.perf_counter()
        self.groups: ParallelGroups = build_groups(self.layout, world, timeout=timeout)
        t2 = time.perf_counter()
        first, last = self.layout.layers
        self.module = GPTStage(cfg, first=first, last=last, tp=self.groups.tp, device=self.device)
        self.module.train()
        self.optimizer = build_optimizer(self.module, spec.optim)
        dataset = TokenDataset(seq_len=cfg.seq_len, seed=spec.data_seed, path=spec.data_path)
        dataset.check_vocab(cfg.vocab_size)
        self.transaction = StepTransaction(
            module=self.module,
            optimizer=self.optimizer,
            layout=self.layout,
            groups=self.groups,
            dataset=dataset,
            optim=spec.optim,
            layer_of=functools.partial(layer_of, cfg=cfg),
            d_model=cfg.d_model,
            device=self.device,
            grad_dtype=torch.float64 if spec.exact_grad_sum else torch.float32,
        )
        self.step = 0
        """Committed steps so far (the index of the next step)."""
        _log(
            f"rank {self.layout.rank} (pipeline {self.layout.pipeline} stage {self.layout.stage} tp "
            f"{self.layout.tp_rank}): joined the world in {t1 - t0:.2f} s, built "
            f"{len(self.layout.all_group_ranks())} groups in {t2 - t1:.2f} s, ready in {time.perf_counter() - t0:.2f} s"
        )

    def train(self, steps: int, *, on_step: Callable[[StepReport], None] | None = None) -> list[StepReport]:
        """Run steps until `steps` are committed; a discarded step propagates StepDiscarded."""
        reports = []
        while self.step < steps:
            report = self.transaction.run(self.step)
            self.step += 1
            reports.append(report)
            if on_step is not None:
                on_step(report)
        return reports

    def full_state(self) -> dict[str, torch.Tensor]:
        """Full fp32 parameters of my stage (collective over my tensor-parallel group)."""
        return full_state_dict(self.module, self.groups.tp)

    def save_outputs(self, reports: list[StepReport], train_seconds: float) -> None:
        """Pipeline 0's stages write their full parameters; rank 0 writes the step results."""
        state = self.full_state()
        if self.layout.pipeline == 0 and self.layout.tp_rank == 0:
            path = self.spec.stage_state_path(self.layout.stage)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
        if self.layout.rank == 0:
            result = {
                "steps_committed": self.step,
                "losses": [r.loss for r in reports],
                "grad_norms": [r.grad_norm for r in reports],
                "lrs": [r.lr for r in reports],
                "step_seconds": [r.seconds for r in reports],
                "train_seconds": train_seconds,
            }
            self.spec.result_path.write_text(json.dumps(result, indent=1))

    def close(self) -> None:
        dist.barrier(group=self.groups.world)
        dist.destroy_process_group()


def run_worker(spec: JobSpec, *, node: int, local_rank: int, store: dist.Store) -> None:
    """Train `spec` as worker `local_rank` of `node`, then save and leave the groups."""
    torch.set_num_threads(spec.threads_per_worker)
    trainer = Trainer(spec, node=node, local_rank=local_rank, store=store)
    seq_tokens = spec.plan.global_batch * spec.model_config.seq_len

    def progress(r: StepReport) -> None:
        if trainer.layout.rank == 0:
            print(
                f"step {r.step + 1}/{spec.steps}  loss {r.loss:.4f}  grad_norm {r.grad_norm:.3f}  "
                f"lr {r.lr:.2e}  {r.seconds * 1000:.0f} ms  {seq_tokens / r.seconds:.0f} tok/s",
                flush=True,
            )

    start = time.perf_counter()
    reports = trainer.train(spec.steps, on_step=progress)
    train_seconds = time.perf_counter() - start
    trainer.save_outputs(reports, train_seconds)
    trainer.close()
