"""The training engine of one worker process, for the whole job, across generations.

`Trainer` is built once per worker process and joins one generation after another with
`start()`: each generation brings a new layout, new process groups and a new stage module
(built by elastic/engine/generation.py). The (layer, tensor-parallel rank) shards the worker
held before and still needs are kept in place (the same parameter tensors and AdamW state
objects: elastic/engine/shard_store.py); the missing ones come from its peers of the new
generation or from a fetch function (in a live job: over gRPC from their surviving holders).
Steps are two calls, `prepare_step()` and `commit()`, so a control plane can decide between
them whether the step commits. The static reference loop (one generation, no control plane) is
elastic/engine/static_loop.py.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from elastic.comm import Recorder
from elastic.data.dataset import TokenDataset
from elastic.engine.adamw import MasterAdamW
from elastic.engine.checkpoint.slices import CheckpointPart
from elastic.engine.device import bind, select_device
from elastic.engine.eval import eval_due, evaluate
from elastic.engine.generation import Generation, GenerationBuilder, Part, joined
from elastic.engine.graveyard import Graveyard
from elastic.engine.optim_checkpoint import sliced_parts
from elastic.engine.optim_repair import moment_spans
from elastic.engine.shard_store import FetchFn, ShardState, ShardStore
from elastic.engine.step import KeptGrads, PreparedStep, StepDiscarded
from elastic.model.gpt import GPTStage
from elastic.model.naming import layer_of
from elastic.model.state import full_state_dict
from elastic.parallel.abort import AbortSignal, StepAborted
from elastic.parallel.groups import ParallelGroups
from elastic.parallel.layout import ParallelLayout
from elastic.records.job import JobSpec
from elastic.records.partial import ReplayRecord
from elastic.records.progress import StepResult
from elastic.records.recovery_timings import ReconfigTimings
from elastic.transfer.moves import ShardMove
from elastic.transfer.shards import ShardKey
from templates.optim_slices import SliceOwnership
from templates.plan import Plan


class Trainer:
    """One worker of a job: its stage, optimizer and step counter, across generations."""

    layout: Part[ParallelLayout] = Part()
    groups: Part[ParallelGroups] = Part()
    module: Part[GPTStage] = Part()
    optimizer: Part[MasterAdamW] = Part()
    """The current generation's layout, process groups, stage module and optimizer
    (RuntimeError before `start()`)."""

    def __init__(self, spec: JobSpec, *, node: int, local_rank: int, recorder: Recorder | None = None) -> None:
        """`recorder`: log every communicator operation of every generation there (the
        recording group, elastic/comm/record.py: for tests and for diagnosing a hang)."""
        self.spec, self.node, self.local_rank = spec, node, local_rank
        self.recorder = recorder
        self.cfg = spec.model_config
        self.device = select_device(local_rank, want=spec.device)
        bind(self.device)
        self.dataset = TokenDataset(seq_len=self.cfg.seq_len, seed=spec.data_seed, path=spec.data_path,
                                    held_out=spec.eval_every > 0)
        self.dataset.check_vocab(self.cfg.vocab_size)
        self.layer_of = functools.partial(layer_of, cfg=self.cfg)
        self.step = 0
        """Index of the next step to run (= committed steps so far)."""
        self.last_report: StepResult | None = None
        """The last step committed (or skipped) by this worker."""
        self.evals: list[tuple[int, float]] = []
        """(committed steps, validation loss) of each evaluation of `train()` (the non-elastic path)."""
        self._builder = GenerationBuilder(spec, node=node, local_rank=local_rank, device=self.device,
                                          dataset=self.dataset, layer_of=self.layer_of, recorder=recorder)
        self._current: Generation | None = None
        self._prepared: PreparedStep | None = None
        self._graveyard = Graveyard()
        """Groups of past generations: never destroyed, an abandoned operation may be pending."""
        self._shards = ShardStore()
        self._lock = self._shards.lock
        """The shard store's lock: held across the optimizer update and the switch (they change
        what export_shard serves), and around the graveyard."""
        self._kept: KeptGrads | None = None
        """Gradient sums of an interrupted step this worker finished (partial replay)."""

    def inherit_groups(self, old: Trainer) -> None:
        """Keep `old`'s process groups (its past generations' and its current one) alive in this
        trainer's graveyard, for a trainer that replaces `old` (a checkpoint fallback drops the
        newer state). Destroying a gloo group that has an abandoned operation pending blocks the
        destroying thread until the group's timeout (a pending all-reduce held `del` for the
        whole 20 s timeout of a test group), and an abandoned step leaves such operations: they
        are let go once closed (elastic/engine/graveyard.py)."""
        with old._lock:
            current = [] if old._current is None else [old._current.groups]
            for groups in current:
                groups.retire()
            self._graveyard.bury(*old._graveyard.buried(), *current)

    @property
    def generation(self) -> int | None:
        """The generation this trainer last joined (None before the first)."""
        return None if self._current is None else self._current.layout.generation

    def holdings(self) -> list[ShardKey]:
        """The (layer, tp_rank) shards this worker holds now, ascending."""
        return self._shards.keys()

    # ---- joining a generation ------------------------------------------------------------

    def start(
        self,
        *,
        plan: Plan,
        generation: int,
        store: torch.distributed.Store,
        abort: AbortSignal | None,
        fetch: FetchFn | None,
        step: int,
        replay: ReplayRecord | None = None,
        moves: Sequence[ShardMove] | None = None,
        owners: Mapping[int, SliceOwnership] | None = None,
    ) -> ReconfigTimings:
        """Join generation `generation` of `plan` and make `step` the next step to run.

        Kept shards stay in place; missing ones come from `fetch` (with `fetch=None` and
        nothing held, the model is initialised from its seed). The process groups are built
        on `store` under the generation's prefix; `abort` (None: plain waits) is the flag
        every cross-worker wait of this generation's steps checks. `replay`: step `step`
        reuses microbatches kept from its interrupted run (elastic/records/partial.py).
        `moves`: shards moved between the generation's workers over its world group first (every
        worker of the generation is given the same list: elastic/parallel/shard_moves.py); `fetch` gets the rest (shards held
        outside the generation, or that arrived damaged). `owners`: the sharded optimizer's
        slice owners of every layer, by layer (the record's `slice_owners`; None: the plan's own).
        """
        previous = self._current
        new = self._builder.join(
            plan=plan, generation=generation, store=store, abort=abort, fetch=fetch, step=step, replay=replay,
            moves=moves, owners=owners, previous=previous, held=self._shards.held(), kept=self._kept,
            serve=lambda key: self._shards.export(key, copy=False),  # nothing updates them meanwhile
            graveyard=self._graveyard,
        )
        with self._lock:  # the switch: the shards dropped stay servable until the next one
            self._shards.replace(new.served)
            if previous is not None:
                self._graveyard.bury(previous.groups)
            self._current = new.generation
            self._prepared = None
            if not new.keeper:  # a keeper keeps its sums until the replayed step commits
                self._kept = None
            self.step = step
        return new.timings

    def export_shard(self, layer: int, tp_rank: int) -> ShardState:
        """The committed state of one held shard as CPU tensors (KeyError if not held).

        Safe to call from other threads at any time: during `start()` it serves the previous
        generation's state until the switch; shards dropped at the last switch stay
        available, at that switch's state, until the next one.
        """
        bind(self.device)  # gRPC's threads call this: no CUDA call of theirs may land on device 0
        return self._shards.export(ShardKey(layer, tp_rank), copy=True)

    def checkpoint_parts(self, keys: Sequence[ShardKey]) -> list[CheckpointPart]:
        """My parts of a checkpoint of the committed step, `keys` being the shards I write
        (`checkpoint_writer_shards`): those shards whole or, with the optimizer sharded, their
        heads and every slice I write (optim_checkpoint.py). The tensors are the held ones (or
        views of them), on their device: copy them before the next commit, on this thread (the
        checkpoint writer's `save_parts` does, on CUDA without blocking). Never collective."""
        current = joined(self._current)
        if not self.spec.sharded_optimizer:
            return [CheckpointPart(key=k, tensors=self._shards.export(k, copy=False)) for k in keys]
        return sliced_parts(current.layout, self._shards.held(), keys)

    # ---- steps ---------------------------------------------------------------------------

    def prepare_step(self, *, halt: bool | Callable[[], bool] = False) -> PreparedStep:
        """Run step `self.step` up to the optimizer update (`halt`: vote to stop the generation
        after it; a callable is asked right before the vote); StepAborted or StepDiscarded leave
        the state unchanged and the gradients cleared, VoteCutShort leaves the step `pending`."""
        transaction = joined(self._current).transaction
        if self._prepared is not None:
            raise RuntimeError(f"step {self._prepared.step} is prepared: commit or discard it first")
        try:
            self._prepared = transaction.prepare(self.step, halt=halt)
        except (StepAborted, StepDiscarded):
            partial = transaction.partial
            if partial is not None and partial.step == self.step:
                self._kept = partial  # the schedule finished here before the step was abandoned
            raise
        return self._prepared

    @property
    def kept(self) -> KeptGrads | None:
        """Gradient sums of the step `self.step` that this worker finished before it was
        abandoned (partial replay); None if none."""
        kept = self._kept
        return kept if kept is not None and kept.step == self.step else None

    @property
    def pending(self) -> int | None:
        """The step whose vote was cut short here, its reduced gradients kept; None if none."""
        return None if self._current is None else self._current.transaction.pending

    def commit(self, prepared: PreparedStep) -> StepResult:
        """Apply the prepared step's update (no communication) and advance the step counter."""
        transaction = joined(self._current).transaction
        if prepared is not self._prepared:
            raise ValueError(f"step {prepared.step} is not the step prepared by this trainer")
        with self._lock:
            report = transaction.commit(prepared)
            self._advance(report)
        return report

    def complete_pending(self, *, grad_norm: float, loss: float) -> StepResult:
        """Commit the pending step with its vote's outcome as a peer saw it (see StepTransaction.complete)."""
        transaction = joined(self._current).transaction
        with self._lock:
            report = transaction.complete(self.step, grad_norm=grad_norm, loss=loss)
            self._advance(report)
        return report

    def skip(self, *, grad_norm: float, loss: float) -> StepResult:
        """Count step `self.step` as done without an update (every worker agreed that its
        gradient is not finite): the state is unchanged, the next step takes the next samples."""
        self.discard()
        report = StepResult(step=self.step, loss=loss, grad_norm=grad_norm, lr=0.0, seconds=0.0,
                            generation=self.layout.generation, committed_at=time.time())
        with self._lock:
            self._advance(report)
        return report

    def _advance(self, report: StepResult) -> None:
        self._graveyard.close_left(self.device)
        self._kept = None
        self.step += 1
        self._prepared = None
        self.last_report = report

    def discard(self) -> None:
        """Drop the prepared or pending step's gradients; parameters and optimizer state are unchanged."""
        joined(self._current).transaction.discard()
        self._prepared = None

    def evaluate(self) -> float:
        """The validation loss of the committed parameters over `spec.eval_batches` held-out
        microbatches (elastic/engine/eval.py); collective over the generation's world group.
        Only between steps: never while a step is prepared or pending."""
        current = joined(self._current)
        if self._prepared is not None or self.pending is not None:
            raise RuntimeError(f"step {self.step} is prepared or pending: evaluate between steps only")
        current.transaction.sync()
        return evaluate(self.module, layout=self.layout, groups=self.groups, dataset=self.dataset,
                        batches=self.spec.eval_batches, batch_size=self.spec.plan.microbatch_size,
                        d_model=self.cfg.d_model, device=self.device)

    def train(
        self, steps: int, *, on_step: Callable[[StepResult], None] | None = None,
        on_eval: Callable[[int, float], None] | None = None,
    ) -> list[StepResult]:
        """Prepare and commit steps back to back until `steps` are committed (non-elastic),
        evaluating after every `spec.eval_every` of them and after the last (`on_eval(committed,
        loss)`; the results accumulate in `evals`)."""
        reports = []
        while self.step < steps:
            report = self.commit(self.prepare_step())
            reports.append(report)
            if on_step is not None:
                on_step(report)
            if eval_due(self.step, every=self.spec.eval_every, steps=steps):
                self.evals.append((self.step, self.evaluate()))
                if on_eval is not None:
                    on_eval(*self.evals[-1])
        return reports

    # ---- outputs -------------------------------------------------------------------------

    def full_state(self) -> dict[str, torch.Tensor]:
        """Full fp32 parameters of my stage (collective over my tensor-parallel group, and with
        the optimizer sharded over the holders of my layers: every worker calls it)."""
        joined(self._current).transaction.sync()
        return full_state_dict(self.module, self.groups.tp)

    def shutdown(self) -> None:
        """Close the communicators of every generation this trainer joined (the job is over for
        it, or it is dropped): their connections end, and any operation still pending fails."""
        with self._lock:
            every = [*self._graveyard.buried(), *([self._current.groups] if self._current is not None else [])]
        for groups in every:
            groups.close()

    def close(self) -> None:
        """Wait until every worker of the generation is done with collectives (world barrier)."""
        done = torch.zeros((), device=self.device)
        self.groups.wait(self.groups.world.all_reduce(done))
        self.groups.fetch(done)


def held_moments(trainer: Trainer) -> list[tuple[int, int, int, int, int]]:
    """Of each shard `trainer` holds now, the elements whose AdamW moments it has
    (optim_repair.moment_spans; all of them unless the optimizer is sharded): its sync report's
    `moments`."""
    return moment_spans(trainer._shards.held())
