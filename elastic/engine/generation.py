"""Building one worker's part of a new generation from the plan and the shards it holds.

A generation is a layout, process groups (built directly on a store prefix of their own, no
default group), a stage module with its optimizer, and the step transaction that runs steps on
them (`Generation`). `GenerationBuilder.join` makes one: it retires the previous generation's
groups, builds the new ones and the stage's skeleton (meta device: names and shapes, no memory),
gathers the shards this worker misses (elastic/engine/shard_gather.py) while the gradient
buffers are allocated on a thread of their own, and puts the held and gathered tensors in the
skeleton's place. The trainer (elastic/engine/trainer.py) then switches to what it returns.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Generic, Protocol, TypeVar, overload

import torch

from elastic.comm import Recorder
from elastic.comm.device import synchronize
from elastic.data.dataset import TokenDataset
from elastic.engine.adamw import MasterAdamW, ParamState
from elastic.engine.device import backend_for, bind
from elastic.engine.graveyard import Graveyard
from elastic.engine.optim import build_optimizer
from elastic.engine.optim_repair import repair_moments
from elastic.engine.optim_shards import owned_ranges
from elastic.engine.replay_sums import step_replay
from elastic.engine.shard_gather import gather
from elastic.engine.shard_store import FetchFn, Held, ShardState, adopt, shard_bytes
from elastic.engine.step import KeptGrads, StepReplay, StepTransaction
from elastic.model.gpt import GPTStage
from elastic.model.hf_import import load_hf_shards
from elastic.parallel.abort import AbortSignal
from elastic.parallel.grad_accum import GradAccumulator
from elastic.parallel.groups import ParallelGroups, build_groups
from elastic.parallel.layout import ParallelLayout
from elastic.records.job import JobSpec
from elastic.records.partial import ReplayRecord
from elastic.records.recovery_timings import ReconfigTimings
from elastic.transfer.moves import ShardMove
from elastic.transfer.shards import ShardKey
from templates.optim_slices import SliceOwnership
from templates.plan import Plan


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Generation:
    """The generation this worker has joined: what its steps run on."""

    layout: ParallelLayout
    groups: ParallelGroups
    module: GPTStage
    optimizer: MasterAdamW
    transaction: StepTransaction


@dataclass(frozen=True)
class Joined:
    """A generation built by `GenerationBuilder.join`, for the trainer to switch to."""

    generation: Generation
    served: Held
    """The shards of the new stage (the tensors its module and optimizer hold)."""
    keeper: bool
    """Whether this worker's kept gradient sums count in the replayed first step: it keeps
    them until that step commits."""
    timings: ReconfigTimings


def joined(current: Generation | None) -> Generation:
    """`current`, or RuntimeError when the trainer has joined no generation yet."""
    if current is None:
        raise RuntimeError("the trainer has joined no generation yet: call start() first")
    return current


class _HasGeneration(Protocol):
    _current: Generation | None


T = TypeVar("T")


class Part(Generic[T]):
    """A read-only attribute of the trainer that is the part of the same name of its current
    generation (`trainer.layout` is `Generation.layout`): RuntimeError before the first."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type) -> Part[T]: ...

    @overload
    def __get__(self, obj: _HasGeneration, owner: type) -> T: ...

    def __get__(self, obj: _HasGeneration | None, owner: type) -> Part[T] | T:
        if obj is None:
            return self
        value: T = getattr(joined(obj._current), self._name)
        return value


class _Background:
    """A function run on a thread of its own; `result()` joins it (and re-raises its error)."""

    def __init__(self, fn: Callable[[], GradAccumulator], device: torch.device) -> None:
        self._out: list[GradAccumulator] = []
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(fn, device), name="trainer-background", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], GradAccumulator], device: torch.device) -> None:
        try:
            bind(device)
            self._out.append(fn())
        except BaseException as exc:  # handed to the caller of result()
            self._error.append(exc)

    def result(self) -> GradAccumulator:
        self._thread.join()
        if self._error:
            raise self._error[0]
        return self._out[0]


def _set_parameter(module: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    """Put `param` (a tensor kept from the previous generation) in place of `module`'s `name`."""
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, leaf, param)


class GenerationBuilder:
    """Builds the generations of one worker (`node`, `local_rank`) of a job."""

    def __init__(
        self, spec: JobSpec, *, node: int, local_rank: int, device: torch.device, dataset: TokenDataset,
        layer_of: Callable[[str], int], recorder: Recorder | None,
    ) -> None:
        self.spec, self.node, self.local_rank = spec, node, local_rank
        self.cfg = spec.model_config
        self.device, self.dataset, self.layer_of, self.recorder = device, dataset, layer_of, recorder

    def join(
        self, *, plan: Plan, generation: int, store: torch.distributed.Store, abort: AbortSignal | None,
        fetch: FetchFn | None, step: int, replay: ReplayRecord | None, moves: Sequence[ShardMove] | None,
        owners: Mapping[int, SliceOwnership] | None, previous: Generation | None, held: Held, kept: KeptGrads | None,
        serve: Callable[[ShardKey], ShardState], graveyard: Graveyard,
    ) -> Joined:
        """Generation `generation` of `plan` as this worker joins it at `step` (the arguments of
        `Trainer.start`), from the generation it leaves (`previous`), the shards it holds (`held`;
        `serve` exports them to peers) and its kept gradient sums (`kept`). The new groups go to
        `graveyard` if the join fails after they are built."""
        layout = self._layout(plan, generation, step, previous, owners)
        needed = [ShardKey(layer, layout.tp_rank) for layer in layout.stage_plan.held]
        missing = [k for k in needed if k not in held]

        t0 = time.perf_counter()
        if previous is not None:  # retired before the next communicators are made
            previous.groups.retire()  # aborted if its step was abandoned (elastic/parallel/groups.py)
            synchronize(self.device)  # the device finishes what the aborted ones held up
        groups, skeleton, buffers = self._open(layout, store, abort)
        t1 = time.perf_counter()
        try:
            fetched, over_group = gather(layout, groups, missing, held, moves=moves, fetch=fetch, serve=serve,
                                         device=self.device)
            first_step = step_replay(layout, groups, replay, step, kept=kept, layer_of=self.layer_of,
                                     device=self.device)
            t2 = time.perf_counter()
            accum = buffers.result()
            module, optimizer, served, repaired = self._stage(layout, groups, skeleton, needed, held, fetched)
        except BaseException:  # the sharded optimizer's repair (in _stage) is collective too
            graveyard.bury(groups)  # an operation of it may be pending: kept until closed
            raise
        if previous is not None:
            previous.transaction.accum.remove()  # kept parameters must not feed the old buffers
        transaction = self._transaction(layout, groups, module, optimizer, first_step, accum)
        keeper = first_step is not None and replay is not None and replay.is_keeper(self.node, self.local_rank)
        t3 = time.perf_counter()
        _log(
            f"generation {generation}: rank {layout.rank} (pipeline {layout.pipeline} stage {layout.stage} "
            f"tp {layout.tp_rank}{_recomputes(module.recompute)}) kept {len(needed) - len(missing)} shards, fetched {len(fetched)} "
            f"({shard_bytes(fetched)} B) in {t2 - t1:.3f} s, groups in {t1 - t0:.3f} s, "
            + (f"optimizer slices {repaired} B, " if self.spec.sharded_optimizer else "") + "stage in "
            f"{t3 - t2:.3f} s{_replayed(step, first_step)}"
        )
        timings = ReconfigTimings(
            transfer_s=t2 - t1, rebuild_s=(t1 - t0) + (t3 - t2), bytes_fetched=shard_bytes(fetched) + repaired,
            bytes_collective=shard_bytes({k: v for k, v in fetched.items() if k in over_group}) + repaired,
        )
        return Joined(generation=Generation(layout, groups, module, optimizer, transaction), served=served,
                      keeper=keeper, timings=timings)

    def _layout(self, plan: Plan, generation: int, step: int, previous: Generation | None,
                owners: Mapping[int, SliceOwnership] | None) -> ParallelLayout:
        """My layout in `plan`, after checking that joining generation `generation` at `step` is valid."""
        old = None if previous is None else previous.layout
        if old is not None and generation <= old.generation:
            raise ValueError(f"generation {generation} is not newer than the current {old.generation}")
        if old is not None and plan.gpus_per_node != old.tp_size:
            raise ValueError(
                f"tensor-parallel degree changes from {old.tp_size} to {plan.gpus_per_node}: "
                "shards of different degrees do not map onto each other"
            )
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return ParallelLayout(plan=plan, generation=generation, node=self.node, local_rank=self.local_rank,
                              owners=None if owners is None else tuple(owners[n] for n in range(plan.num_layers)))

    def _open(
        self, layout: ParallelLayout, store: torch.distributed.Store, abort: AbortSignal | None
    ) -> tuple[ParallelGroups, GPTStage, _Background]:
        """The generation's process groups (built on `store`), the skeleton of my stage (on the
        meta device: parameter names and shapes only, no memory, no initialisation), and its
        gradient buffers being allocated on a thread of their own: their pages are faulted in
        while shards arrive (a GB for gpt2-124m)."""
        timeout = timedelta(seconds=self.spec.collective_timeout_s)
        groups = build_groups(layout, store, timeout=timeout, backend=backend_for(self.device), device=self.device,
                              abort=abort, recorder=self.recorder)
        with torch.device("meta"):
            skeleton = GPTStage(self.cfg, chunks=layout.stage_plan.ranges, tp=groups.tp, initialise=False,
                                recompute=self._recompute(layout),
                              sequence_parallel=self.spec.sequence_parallel_on)
        buffers = _Background(lambda: StepTransaction.buffers_for(
            skeleton, layout=layout, layer_of=self.layer_of, device=self.device), self.device)
        return groups, skeleton, buffers

    def _recompute(self, layout: ParallelLayout) -> str:
        """What my stage's backward recomputes: the job's forced mode, or what the plan says."""
        return self.spec.stage_recompute(layout.plan.pipelines[layout.pipeline].stages[layout.stage].recompute)

    def _stage(
        self, layout: ParallelLayout, groups: ParallelGroups, skeleton: GPTStage, needed: list[ShardKey],
        held: Held, fetched: dict[ShardKey, ShardState],
    ) -> tuple[GPTStage, MasterAdamW, Held, int]:
        """The generation's stage module and optimizer, the shards they serve, and the bytes of
        optimizer slices received (the sharded optimizer's repair, optim_repair.py).

        Only a worker that starts from nothing initialises: from the seed, or with `--init-from`
        from its own shards of that checkpoint. Otherwise the stage is
        `skeleton` (built on the meta device: no memory, no initialisation) with every parameter
        replaced by a kept tensor (the same object, with its AdamW state) or a fetched one
        (adopted as it is when it already has the parameter's device and dtype).
        """
        repaired = 0
        if not held and not fetched:
            module = GPTStage(self.cfg, chunks=layout.stage_plan.ranges, tp=groups.tp, device=self.device,
                              recompute=self._recompute(layout), initialise=self.spec.init_from is None,
                              sequence_parallel=self.spec.sequence_parallel_on)
            if self.spec.init_from is not None:  # my own shards of a Hugging Face checkpoint
                load_hf_shards(module, self.spec.init_from, tp_rank=layout.tp_rank, tp_size=layout.tp_size)
            optimizer = build_optimizer(module, self.spec.optim, owned=self._owned(layout, module))
        else:
            module = skeleton
            sharded = self.spec.sharded_optimizer
            states: dict[str, ParamState] = {}
            for name, meta in list(module.named_parameters()):
                key = ShardKey(self.layer_of(name), layout.tp_rank)
                if key in held:
                    param, states[name] = held[key][name]
                else:
                    param, states[name] = adopt(key, name, meta, fetched[key], self.device, sliced=sharded)
                _set_parameter(module, name, param)
            owned = self._owned(layout, module)
            if owned is not None:  # every new owner gets what it lacks of its slices (optim_repair.py)
                sources = {n: entry for shard in held.values() for n, entry in shard.items()}
                sources.update({n: (p, states[n]) for n, p in module.named_parameters()})
                states, repaired = repair_moments(layout, groups, sources=sources, owned=owned,
                                                  layer_of=self.layer_of)
            optimizer = build_optimizer(module, self.spec.optim, state=states, owned=owned)
        module.train()
        served: Held = {k: {} for k in needed}
        for name, param in optimizer.params:
            served[ShardKey(self.layer_of(name), layout.tp_rank)][name] = (param, optimizer.state[name])
        return module, optimizer, served, repaired

    def _owned(self, layout: ParallelLayout, module: GPTStage) -> dict[str, tuple[int, int]] | None:
        """The elements of each parameter my optimizer updates when it is sharded (else None)."""
        if not self.spec.sharded_optimizer:
            return None
        return owned_ranges(layout, {n: p.numel() for n, p in module.named_parameters()}, self.layer_of)

    def _transaction(
        self, layout: ParallelLayout, groups: ParallelGroups, module: GPTStage, optimizer: MasterAdamW,
        replay: StepReplay | None, accum: GradAccumulator,
    ) -> StepTransaction:
        """The generation's step transaction."""
        return StepTransaction(
            module=module,
            optimizer=optimizer,
            layout=layout,
            groups=groups,
            dataset=self.dataset,
            optim=self.spec.optim,
            layer_of=self.layer_of,
            d_model=self.cfg.d_model,
            device=self.device,
            tree=self.spec.exact_grad_sum,
            keep_partial=self.spec.partial_replay,
            replay=replay,
            accum=accum,
            split=self.spec.boundary_split,
            tied=self.cfg.tie_embeddings,
            sharded=self.spec.sharded_optimizer,
        )


def _recomputes(mode: str) -> str:
    """" recompute full" in a worker's generation line when its stage recomputes, else nothing."""
    return "" if mode == "none" else f" recompute {mode}"


def _replayed(step: int, replay: StepReplay | None) -> str:
    """The join log's note on a partly replayed first step ("" when none)."""
    if replay is None:
        return ""
    return (
        f", step {step} replays microbatches {list(replay.microbatches)} here"
        + (f" and adds kept sums of {sum(len(named) for named in replay.sums.values())} parameters in "
           f"blocks {[tuple(b) for b in replay.sums]}" if replay.sums else "")
    )
