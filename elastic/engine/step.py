"""One optimizer step as a transaction: it commits everywhere or changes nothing.

The step runs the pipeline schedule over this pipeline's slice of step s's global batch, reduces gradients
across pipelines, and agrees with every worker (one world all-reduce that also carries the gradient norm
and loss). Only then may it commit: set the learning rate of step s and apply AdamW (the caller advances
its step counter). Preparing and committing are two calls, so a control plane can act between them. Any
error before the world all-reduce (a peer that died, a timeout, an abort) or a non-finite gradient
anywhere discards the step: gradients are cleared, and the parameters, optimizer moments and step counts
are exactly as they were, so the same step can be replayed with the same samples. An error in the wait of
the world all-reduce itself (the vote) keeps the reduced gradients as the pending step (VoteCutShort): a
peer may have seen the vote complete and committed, and then `complete()` commits the same step here with
the vote's outcome, bit-identically.

Partial replay (elastic/records/partial.py): the cross-pipeline reduction writes its result beside the
gradient sums, never into them, so when a step is abandoned after its schedule finished here, the worker
copies its own sums then (`partial`, a `KeptGrads`) and the copy survives into the next generation; a step
that commits copies nothing. That generation's first step may be a `StepReplay`: this pipeline computes
only the listed microbatches, and a keeper adds its kept sums (and their loss) before the reduction.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from elastic.data.dataset import TokenDataset, step_sample_indices
from elastic.engine.adamw import MasterAdamW
from elastic.engine.device import compute_precision
from elastic.engine.optim import OptimConfig, lr_at
from elastic.engine.optim_shards import gather_params, post_gather
from elastic.engine.param_gather import layer_modules, waited_on_first_use
from elastic.engine.shard_reduce import sharded_paths
from elastic.engine.stage_links import stage_actions, stage_spec, tp_gather
from elastic.parallel.abort import StepAborted
from elastic.parallel.blocks import Block, decompose
from elastic.parallel.bucket_reducer import BucketReducer, plan_blocks
from elastic.parallel.buckets import accum_buckets, bucket_layout
from elastic.parallel.exchange import TreeExchange
from elastic.parallel.executor import MicrobatchResult, run_schedule
from elastic.parallel.grad_accum import GradAccumulator
from elastic.parallel.grad_sync import GradStats, VoteInterrupted, clip_grads, finalize_grads
from elastic.parallel.groups import ParallelGroups
from elastic.parallel.layout import ParallelLayout, assign_ranks
from elastic.parallel.phase_clock import PhaseClock, StepPhases, TimedWait
from elastic.records.partial import PartialReport, ReplayRecord, split_microbatches
from elastic.records.progress import StepResult
from templates.plan import Plan


class StepDiscarded(RuntimeError):
    """A step that did not commit because of a local error or a non-finite gradient anywhere;
    the training state is unchanged."""


class NonFiniteStep(StepDiscarded):
    """Every worker agreed (through the vote) that the step's gradient or loss is not finite."""

    def __init__(self, message: str, *, step: int, grad_norm: float, loss: float) -> None:
        super().__init__(message)
        self.step, self.grad_norm, self.loss = step, grad_norm, loss


class VoteCutShort(StepAborted):
    """The wait of the step's vote failed here: the reduced gradients are kept as the pending
    step until `complete()` or `discard()`."""


@dataclass(frozen=True, kw_only=True)
class KeptGrads:
    """One worker's gradient sums of a step whose schedule it finished, kept past an abort."""

    step: int
    """The step."""
    microbatches: tuple[int, ...]
    """Global microbatch indices the sums hold (this pipeline's share of the step)."""
    layers: tuple[int, int]
    """Planning layers [first, last) of the stage the sums belong to (chunk 0's when interleaved)."""
    tp_rank: int
    """Tensor-parallel rank of the stage."""
    grads: dict[Block, dict[str, torch.Tensor]]
    """Block of the step's summation tree -> canonical parameter name -> the sum (the
    accumulator's dtype), before any reduction: the blocks of `microbatches`."""
    loss_sum: float
    """This worker's share of the step's loss (non-zero on a last stage's TP rank 0 only)."""
    finite: bool
    """Whether every loss of these microbatches was finite."""
    chunks: tuple[tuple[int, int], ...] = ()
    """Under interleaving, each chunk's layer range; empty: `layers`."""

    def report(self) -> PartialReport:
        return PartialReport(step=self.step, microbatches=self.microbatches, layers=self.layers, tp_rank=self.tp_rank,
                             chunks=self.chunks)


@dataclass(frozen=True, kw_only=True)
class StepReplay:
    """The first step of a generation after a failure: only the microbatches not kept."""

    step: int
    """The step replayed."""
    microbatches: tuple[int, ...]
    """Global microbatch indices this pipeline computes (possibly none)."""
    blocks: dict[int, tuple[Block, ...]]
    """World rank -> the blocks it sends in this step (every worker computes the same,
    `replay_blocks`): those of the microbatches it computes, of its kept sums and of the kept
    sums moved to it."""
    sums: dict[Block, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Kept gradient sums this worker adds before the reduction (block -> canonical name ->
    sum): its own for the layers it still holds, and those moved to it with a layer."""
    loss_sum: float = 0.0
    """The kept share of the step's loss this worker adds (a keeper's `KeptGrads.loss_sum`)."""
    finite: bool = True
    """Whether the kept losses were all finite."""


def replay_blocks(replay: ReplayRecord, plan: Plan) -> dict[int, tuple[Block, ...]]:
    """World rank -> the blocks it sends in the replayed step `replay` of `plan`: those of its
    pipeline's share of the missing microbatches, of its own kept set (a keeper) and of the
    kept sets moved to it. A function of the record and the plan, so every worker computes
    the same lists; a block a worker holds for some layers only is zeros for the others."""
    shares = split_microbatches(plan, replay.missing)
    sets = {(k[0], k[1]): tuple(mbs) for k, mbs in zip(replay.keepers, replay.kept_sets, strict=True)}
    received: dict[tuple[int, int], set[tuple[int, ...]]] = {}
    for _, _, fn, fr, tn, tr in replay.moved:
        received.setdefault((tn, tr), set()).add(sets[(fn, fr)])
    out: dict[int, tuple[Block, ...]] = {}
    for w in assign_ranks(plan):
        me = (w.node, w.local_rank)
        held = [shares[w.pipeline], sets.get(me, ()), *received.get(me, set())]
        out[w.rank] = tuple(sorted({b for mbs in held for b in decompose(mbs)}))
    return out


@dataclass(frozen=True, kw_only=True)
class PreparedStep:
    """A step whose gradients are reduced and agreed on everywhere, not yet applied."""

    step: int
    """Index of the step."""
    loss: float
    """Mean loss over the global batch."""
    grad_norm: float
    """Global gradient norm before clipping."""
    started: float
    """`time.perf_counter()` when the step began on this worker."""
    halt: bool = False
    """Whether the vote asked the generation to halt after this step (all workers agree)."""
    phases: dict[int, StepPhases] = field(default_factory=dict)
    """Each node's forward, backward and wait seconds of the step, from the vote (GradStats.phases)."""


def dropout_key(step: int, global_microbatch: int) -> int:
    """Dropout seed of one microbatch: a function of (step, global microbatch index) only, so
    masks do not depend on the plan."""
    return step * 1_000_003 + global_microbatch


class StepTransaction:
    """Runs steps of one worker's stage under one layout; holds no step counter of its own."""

    def __init__(
        self,
        *,
        module: torch.nn.Module,
        optimizer: MasterAdamW,
        layout: ParallelLayout,
        groups: ParallelGroups,
        dataset: TokenDataset,
        optim: OptimConfig,
        layer_of: Callable[[str], int],
        d_model: int,
        device: torch.device,
        tree: bool = True,
        keep_partial: bool = False,
        replay: StepReplay | None = None,
        accum: GradAccumulator | None = None,
        split: int = 1,
        sharded: bool = False,
        tied: bool = False,
    ) -> None:
        """`accum`: gradient buffers allocated beforehand for this stage's parameters and
        buckets (`StepTransaction.buffers_for`); attached here. `split`: parts each boundary
        tensor travels in (scatter/gather, `JobSpec.boundary_split`). `sharded`: the optimizer is
        sharded (`shard_reduce.sharded_paths`). `tied`: the
        model ties its embedding and head (elastic/parallel/tied.py)."""
        self.tied = tied
        self.module, self.optimizer = module, optimizer
        self.layout, self.groups = layout, groups
        self.dataset, self.optim, self.layer_of = dataset, optim, layer_of
        self.device = device
        if accum is None:
            accum = StepTransaction.buffers_for(module, layout=layout, layer_of=layer_of, device=device)
        accum.attach(module)
        self.accum = accum
        self.buckets = accum_buckets(accum, layout, layer_of)
        """The accumulator's gradient buckets (`buckets.accum_buckets`)."""
        self.exchange = TreeExchange(device=device, recorder=groups.recorder)
        """Where the steps' buckets are reduced (its thread is kept from step to step)."""
        self.tree = tree
        """Reduce in the step's summation tree (`JobSpec.exact_grad_sum`); False: gloo's all-reduce."""
        self.plan_blocks = plan_blocks(layout)
        """World rank -> the blocks its pipeline computes in a step without replay."""
        plan = layout.plan
        self.actions = stage_actions(layout, layout.num_microbatches)
        self.spec = stage_spec(layout, module, batch=plan.microbatch_size, seq_len=dataset.seq_len, d_model=d_model,
                               device=device, split=split)
        self.interleaved = self.spec.chunks > 1
        """v > 1: buckets are launched together after the schedule, in the global order."""
        self.gather, self.sharded = sharded_paths(layout, module, self.buckets, layer_of, on=sharded, tree=tree, tied=tied)
        """Sharded: the parameter gather (`optim_shards`), the exchange's second phases (`shard_reduce`)."""
        self.behind = sharded
        """Sharded: parameters outside my slices may be an update behind until the next `sync`
        or the next step's gather (waited layer by layer: elastic/engine/param_gather.py)."""
        self.layer_modules = {} if self.gather is None else layer_modules(module, layer_of)
        self.pending: int | None = None
        """A step whose vote this worker joined but did not see complete (gradients kept)."""
        self.keep_partial = keep_partial and len(layout.plan.pipelines) > 1
        """Whether each step copies its sums after the schedule (useless with one pipeline)."""
        self.replay = replay
        """The generation's first step, when only part of it is computed here."""
        self.partial: KeptGrads | None = None
        """The sums of a step abandoned after its schedule finished here, copied when it was
        abandoned (the reduction leaves the sums as they are); None once a step commits. A
        caller keeps them for the next generation."""
        self._finished: KeptGrads | None = None
        """The step being prepared once its schedule finished here: what `partial` becomes if
        it is abandoned, without the copy of the sums (nor its loss, read then: `_loss`)."""
        self._loss: torch.Tensor | None = None
        """That step's loss share on the device (float64), read only if it is abandoned."""

    @staticmethod
    def buffers_for(
        module: torch.nn.Module, *, layout: ParallelLayout, layer_of: Callable[[str], int],
        device: torch.device, dtype: torch.dtype = torch.float32,
    ) -> GradAccumulator:
        """Gradient buffers for `module`'s parameters (a meta skeleton will do), one flat buffer
        per gradient bucket (`buckets.bucket_layout`), padded for an even reduce-scatter over
        the bucket's holders, not yet attached."""
        sizes = {name: p.numel() for name, p in module.named_parameters()}
        buckets = bucket_layout(list(sizes), layout, layer_of, sizes)
        return GradAccumulator(
            module, dtype=dtype, partition=[names for _, names in buckets],
            pad=[len(bucket.ranks) for bucket, _ in buckets], device=device, attach=False,
        )

    def _microbatch(self, step: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and targets of global microbatch `g` of step `step`."""
        plan = self.layout.plan
        samples = step_sample_indices(step, plan.global_batch)
        mbs = plan.microbatch_size
        return self.dataset.batch(samples[g * mbs : (g + 1) * mbs])

    def _replaying(self, step: int) -> StepReplay | None:
        return self.replay if self.replay is not None and self.replay.step == step else None

    def microbatches(self, step: int) -> tuple[int, ...]:
        """Global indices of the microbatches this pipeline computes in step `step`."""
        replay = self._replaying(step)
        if replay is not None:
            return replay.microbatches
        offset = self.layout.microbatch_offset
        return tuple(range(offset, offset + self.layout.num_microbatches))

    def prepare(self, step: int, *, halt: bool | Callable[[], bool] = False) -> PreparedStep:
        """Run step `step` up to, not including, the optimizer update; `halt`: vote to stop
        the generation after this step (a callable is asked right before the vote).

        StepAborted when the generation's abort flag was set during the step, StepDiscarded on
        any other failure, NonFiniteStep on a non-finite gradient anywhere; in these cases
        gradients are cleared and parameters, optimizer state and step counts are untouched.
        VoteCutShort when the vote's own wait failed: the gradients stay as `pending`.
        """
        start = time.perf_counter()
        self.discard()
        self.partial = self._finished = None
        try:
            stats = self._forward_backward_reduce(step, halt=halt)
        except VoteInterrupted as exc:
            self._keep_partial()
            self.pending = step
            raise VoteCutShort(f"step {step}: the vote was cut short on rank {self.layout.rank}: {exc}") from exc
        except Exception as exc:
            self._keep_partial()
            self.discard()
            abort = self.groups.abort
            if abort is not None and abort.is_set():
                if isinstance(exc, StepAborted):
                    raise
                raise StepAborted(f"step {step} aborted on rank {self.layout.rank}: {abort.reason}") from exc
            raise StepDiscarded(f"step {step} discarded on rank {self.layout.rank}: {exc}") from exc
        self._finished = None
        if not stats.ok:
            self.discard()
            raise NonFiniteStep(
                f"step {step} discarded: a worker failed or the gradient norm is {stats.grad_norm}",
                step=step, grad_norm=stats.grad_norm, loss=stats.loss,
            )
        return PreparedStep(step=step, loss=stats.loss, grad_norm=stats.grad_norm, started=start, halt=stats.halt,
                            phases=stats.phases)

    def _keep_partial(self) -> None:
        """The step is abandoned: copy this worker's sums of it, if its schedule finished here."""
        if self._finished is not None:
            loss = 0.0 if self._loss is None else float(self._loss)
            self.partial = dataclasses.replace(self._finished, grads=self.accum.snapshot(), loss_sum=loss,
                                               finite=math.isfinite(loss))
            self._finished = self._loss = None

    def complete(self, step: int, *, grad_norm: float, loss: float) -> StepResult:
        """Commit the pending step `step` with its vote's outcome as a peer saw it complete:
        the same clip factor and update as on that peer."""
        if self.pending != step:
            raise ValueError(f"step {step} is not pending here (pending: {self.pending})")
        clip_grads(self.accum, grad_norm=grad_norm, grad_clip=self.optim.grad_clip)
        return self.commit(PreparedStep(step=step, loss=loss, grad_norm=grad_norm, started=time.perf_counter()))

    def commit(self, prepared: PreparedStep) -> StepResult:
        """Apply the optimizer with the prepared gradients (no communication); what the step
        produced, committed in this layout's generation now."""
        lr = lr_at(prepared.step, self.optim)
        self.optimizer.lr = lr
        self.accum.write_grads()
        self.optimizer.step()
        self.behind = self.gather is not None
        self.discard()
        self.partial = None
        if self.replay is not None and self.replay.step <= prepared.step:
            self.replay = None
        return StepResult(
            step=prepared.step,
            loss=prepared.loss,
            grad_norm=prepared.grad_norm,
            lr=lr,
            seconds=time.perf_counter() - prepared.started,
            generation=self.layout.generation,
            committed_at=time.time(),
        )

    def sync(self) -> None:
        """Sharded: bring every parameter up to the last commit (the gather over the holders
        of my layers; a failed one is repeated). Nothing to do unsharded or when up to date."""
        if self.gather is not None and self.behind:
            gather_params(self.gather, dict(self.module.named_parameters()), self.groups)
            self.behind = False

    def discard(self) -> None:
        """Drop any gradients of a step, pending or not (state unchanged)."""
        self.accum.listener = None
        self.optimizer.zero_grad()
        self.accum.zero()
        self.pending = None

    def run(self, step: int) -> StepResult:
        """Prepare and commit step `step` back to back (the non-elastic path)."""
        return self.commit(self.prepare(step))

    def _forward_backward_reduce(self, step: int, *, halt: bool | Callable[[], bool]) -> GradStats:
        layout = self.layout
        total_mbs = layout.plan.global_microbatches
        replay = self._replaying(step)
        mbs = self.microbatches(step)
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
            if m not in cache:
                cache[m] = self._microbatch(step, mbs[m])
            return cache[m]

        pending = None
        if self.gather is not None and self.behind:
            pending = post_gather(self.gather, dict(self.module.named_parameters()), self.groups.p2p)
        # A replayed step adds kept sums after its schedule: its buckets are launched after that.
        if self.exchange.abandoned:
            self.exchange = TreeExchange(device=self.device, recorder=self.groups.recorder)
        blocks_of = self.plan_blocks if replay is None else replay.blocks.__getitem__
        self.accum.begin(blocks_of(layout.rank))
        reducer = BucketReducer(accum=self.accum, layout=layout, groups=self.groups, layer_of=self.layer_of,
                                known=self.buckets, exchange=self.exchange, tree=self.tree, blocks_of=blocks_of,
                                sharded=self.sharded)
        losses = MicrobatchResult()
        # A failure in another pipeline lets this one finish (and keep) its microbatches; a
        # replayed step keeps nothing, so any abort ends it.
        wait = TimedWait(self.groups.wait_local if replay is None else self.groups.wait)
        clock = PhaseClock(self.device) if replay is None else None
        gather_wait = TimedWait(self.groups.wait)
        try:
            with waited_on_first_use(pending, self.layer_modules, wait=gather_wait, clock=clock):
                if mbs:
                    actions = self.actions if replay is None else stage_actions(layout, len(mbs))
                    result = run_schedule(
                        self.module,
                        actions,
                        spec=self.spec,
                        group=self.groups.world,
                        wait=wait,
                        post=self.groups.p2p_local if replay is None else self.groups.p2p,
                        device=self.device,
                        tokens=lambda m: batch(m)[0],
                        targets=lambda m: batch(m)[1],
                        loss_scale=1.0 / total_mbs,
                        dropout_key=lambda m: dropout_key(step, mbs[m]),
                        autocast=lambda: compute_precision(self.device),
                        before_final_backward=reducer.arm if replay is None and not self.interleaved else None,
                        before_backward=lambda m: self.accum.leaf(mbs[m]),
                        clock=clock,
                        gather=tp_gather(self.groups) if self.spec.split > 1 else None,
                    )
                    losses = result
        except BaseException:
            reducer.abandon()  # buckets handed to its exchange thread must not be written any more
            raise
        finally:
            if pending is not None and not pending.handles:
                self.behind = False
        # A replayed step is no measure of this node's speed (it redoes part of a step): 0, unmeasured.
        phases = StepPhases() if clock is None else functools.partial(clock.totals, wait=wait.seconds + gather_wait.seconds)
        counted = layout.is_last_stage and layout.tp_rank == 0
        # The losses stay on the device: their sum is read with the vote (a non-finite one fails it).
        loss_sum = losses.loss_sum(self.device) / total_mbs if counted else torch.zeros(
            (), dtype=torch.float64, device=self.device)
        ok = True
        if replay is not None:
            for block, sums in replay.sums.items():
                self.accum.add(block, sums)
            loss_sum += replay.loss_sum
            ok = replay.finite
        elif replay is None and self.keep_partial:
            self._finished = KeptGrads(step=step, microbatches=mbs, layers=layout.stage_plan.layers,
                                       chunks=layout.stage_plan.chunks, tp_rank=layout.tp_rank,
                                       grads={}, loss_sum=0.0, finite=True)
            self._loss = loss_sum
        return finalize_grads(
            self.accum, layout=layout, groups=self.groups, layer_of=self.layer_of, loss_sum=loss_sum,
            grad_clip=self.optim.grad_clip, ok=ok, halt=halt, reducer=reducer, phases=phases, tied=self.tied,
        )
