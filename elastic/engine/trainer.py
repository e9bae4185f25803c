"""The training engine of one worker process, for the whole job, across generations.

`Trainer` is built once per worker process and joins one generation after another with
`start()`: each generation brings a new layout, new process groups (built directly on a store
prefix of their own, no default group) and a new stage module. The (layer, tensor-parallel
rank) shards the worker held before and still needs are kept in place (the same parameter
tensors and AdamW state objects); the missing ones come from a fetch function (in a live job:
over gRPC from their surviving holders). Steps are two calls, `prepare_step()` and
`commit()`, so a control plane can decide between them whether the step commits.
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
from torch import nn

from elastic.comm import Recorder
from elastic.comm.device import host_copy, mark, settle, synchronize
from elastic.data.dataset import TokenDataset
from elastic.engine.adamw import MasterAdamW, ParamState
from elastic.engine.device import backend_for, bind, select_device
from elastic.engine.eval import eval_due, evaluate
from elastic.engine.optim import build_optimizer
from elastic.engine.step import (
    KeptGrads,
    PreparedStep,
    StepDiscarded,
    StepReplay,
    StepTransaction,
    replay_blocks,
)
from elastic.model.gpt import GPTStage
from elastic.model.naming import layer_of
from elastic.model.state import full_state_dict
from elastic.parallel.abort import AbortSignal, StepAborted
from elastic.parallel.blocks import Block
from elastic.parallel.grad_accum import GradAccumulator
from elastic.parallel.groups import ParallelGroups, build_groups
from elastic.parallel.layout import ParallelLayout, assign_ranks
from elastic.records.job import JobSpec
from elastic.records.partial import ReplayRecord, split_microbatches
from elastic.records.progress import StepResult
from elastic.records.recovery_timings import ReconfigTimings
from elastic.transfer.collective import ShardMove, assign_moves, exchange
from elastic.transfer.shards import ShardKey
from templates.plan import Plan

ShardState = dict[str, torch.Tensor]
"""One shard's committed state: `param/<name>`, `exp_avg/<name>`, `exp_avg_sq/<name>` per
parameter of the layer (CPU tensors), and `step` (0-d int64: the AdamW step count)."""

FetchFn = Callable[[list[ShardKey]], dict[ShardKey, ShardState]]
"""Gets the state of shards this worker does not hold from their holders."""

HoldingsFn = Callable[[], dict[int, list[ShardKey]]]
"""Rank of the new generation -> the shards that worker holds now (the collective path's input:
every worker must see the same map)."""

_Held = dict[ShardKey, dict[str, tuple[nn.Parameter, ParamState]]]
"""Shard -> canonical name -> (parameter, its AdamW state)."""


_SUMS_TAG = 8
"""Tag of the kept gradient sums' exchange (the shards' own exchange uses the default, 7)."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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


def _shard_bytes(shards: dict[ShardKey, ShardState]) -> int:
    return sum(t.numel() * t.element_size() for shard in shards.values() for t in shard.values())


def _adopt(
    key: ShardKey, name: str, skeleton: nn.Parameter, shard: ShardState, device: torch.device
) -> tuple[nn.Parameter, ParamState]:
    """The parameter `name` and its AdamW state made from a fetched shard: its tensors are used
    as they are when they already have the device, dtype and layout (no copy), else copied."""
    if "step" not in shard:
        raise ValueError(f"fetched shard {key} has no 'step' count")
    tensors = []
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        src = shard.get(f"{kind}/{name}")
        if src is None:
            raise ValueError(f"fetched shard {key} lacks {kind}/{name}")
        if tuple(src.shape) != tuple(skeleton.shape):
            raise ValueError(
                f"fetched shard {key}: {kind}/{name} has shape {tuple(src.shape)}, expected {tuple(skeleton.shape)}"
            )
        if src.device != device or src.dtype != skeleton.dtype or not src.is_contiguous():
            src = src.to(device=device, dtype=skeleton.dtype).contiguous()
        tensors.append(src.detach())
    param = nn.Parameter(tensors[0])
    param.__dict__.update(skeleton.__dict__)  # tensor-parallel attributes (tp_dim, full_shape)
    return param, ParamState(exp_avg=tensors[1], exp_avg_sq=tensors[2], step=int(shard["step"]))


def _export(key: ShardKey, entries: dict[str, tuple[nn.Parameter, ParamState]], *, copy: bool) -> ShardState:
    """One shard's tensors by name: host copies (`copy`: on CUDA through pinned memory, waited
    for here), or the held tensors themselves (with the step count on their device)."""
    out: ShardState = {}
    steps = set()
    for name, (param, state) in entries.items():
        for kind, t in (("param", param.detach()), ("exp_avg", state.exp_avg), ("exp_avg_sq", state.exp_avg_sq)):
            out[f"{kind}/{name}"] = host_copy(t) if copy else t
        steps.add(state.step)
    assert len(steps) == 1, f"shard {key}: parameters disagree on the AdamW step count {steps}"
    held = next(iter(entries.values()))[0].device
    if copy:
        settle(mark(held))
    out["step"] = torch.tensor(steps.pop(), dtype=torch.int64, device=torch.device("cpu") if copy else held)
    return out


def _rounds(moves: list[ShardMove]) -> list[list[ShardMove]]:
    """`moves` split into rounds in which no (shard, receiver) pair repeats: the n-th move of
    each pair, by sender, in round n (every worker computes the same rounds)."""
    rounds: list[list[ShardMove]] = []
    seen: dict[tuple[ShardKey, int], int] = {}
    for m in sorted(moves, key=lambda m: (m.src, m.dst, m.key)):
        n = seen.get((m.key, m.dst), 0)
        seen[(m.key, m.dst)] = n + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(m)
    return rounds


def _set_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Put `param` (a tensor kept from the previous generation) in place of `module`'s `name`."""
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, leaf, param)


class Trainer:
    """One worker of a job: its stage, optimizer and step counter, across generations."""

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
        self._layout: ParallelLayout | None = None
        self._groups: ParallelGroups | None = None
        self._module: GPTStage | None = None
        self._optimizer: MasterAdamW | None = None
        self._transaction: StepTransaction | None = None
        self._prepared: PreparedStep | None = None
        self._graveyard: list[ParallelGroups] = []
        """Groups of past generations: never destroyed, an abandoned operation may be pending."""
        self._closed = 0
        """How many graveyard entries are closed (their connections: elastic/parallel/groups.py, `close`)."""
        self._lock = threading.Lock()
        """Guards what export_shard serves against the optimizer update and the switch."""
        self._served: _Held = {}
        self._kept: KeptGrads | None = None
        """Gradient sums of an interrupted step this worker finished (partial replay)."""
        self._retired: _Held = {}
        """Shards dropped at the last switch, still at that switch's committed state, so slower
        peers of the same reconfiguration can fetch them from this worker."""

    def _close_retired(self) -> None:
        """Close the groups retired since the last call, on a thread of their own: a step of
        this generation committed, so every worker of it has left the older generations
        (elastic/parallel/groups.py). Called under the lock."""
        retired, self._closed = self._graveyard[self._closed:], len(self._graveyard)

        def close() -> None:
            bind(self.device)
            for groups in retired:
                groups.close()

        threading.Thread(target=close, name="close-retired-groups", daemon=True).start()

    def inherit_groups(self, old: Trainer) -> None:
        """Keep `old`'s process groups (its past generations' and its current one) alive in this
        trainer's graveyard, for a trainer that replaces `old` (a checkpoint fallback drops the
        newer state). Destroying a gloo group that has an abandoned operation pending blocks the
        destroying thread until the group's timeout (a pending all-reduce held `del` for the
        whole 20 s timeout of a test group), and an abandoned step leaves such operations."""
        with old._lock:
            if old._groups is not None:
                old._groups.retire()
            self._graveyard += old._graveyard + ([old._groups] if old._groups is not None else [])

    # ---- the current generation ----------------------------------------------------------

    def _require(self) -> StepTransaction:
        if self._transaction is None:
            raise RuntimeError("the trainer has joined no generation yet: call start() first")
        return self._transaction

    @property
    def layout(self) -> ParallelLayout:
        self._require()
        assert self._layout is not None
        return self._layout

    @property
    def generation(self) -> int | None:
        """The generation this trainer last joined (None before the first)."""
        return None if self._layout is None else self._layout.generation

    @property
    def groups(self) -> ParallelGroups:
        self._require()
        assert self._groups is not None
        return self._groups

    @property
    def module(self) -> GPTStage:
        self._require()
        assert self._module is not None
        return self._module

    @property
    def optimizer(self) -> MasterAdamW:
        self._require()
        assert self._optimizer is not None
        return self._optimizer

    def holdings(self) -> list[ShardKey]:
        """The (layer, tp_rank) shards this worker holds now, ascending."""
        with self._lock:
            return sorted(self._served)

    # ---- joining a generation ------------------------------------------------------------

    def _open_generation(
        self, layout: ParallelLayout, store: torch.distributed.Store, abort: AbortSignal | None
    ) -> tuple[ParallelGroups, GPTStage, _Background]:
        """The generation's process groups (built on `store`), the skeleton of my stage (on the
        meta device: parameter names and shapes only, no memory, no initialisation), and its
        gradient buffers being allocated on a thread of their own: their pages are faulted in
        while shards arrive (a GB for gpt2-124m)."""
        timeout = timedelta(seconds=self.spec.collective_timeout_s)
        groups = build_groups(layout, store, timeout=timeout, backend=backend_for(self.device), device=self.device,
                              abort=abort, recorder=self.recorder)
        first, last = layout.layers
        with torch.device("meta"):
            skeleton = GPTStage(self.cfg, first=first, last=last, tp=groups.tp, initialise=False)
        buffers = _Background(lambda: StepTransaction.buffers_for(
            skeleton, layout=layout, layer_of=self.layer_of, device=self.device), self.device)
        return groups, skeleton, buffers

    def _new_transaction(
        self, layout: ParallelLayout, groups: ParallelGroups, module: GPTStage, optimizer: MasterAdamW,
        replay: StepReplay | None, accum: GradAccumulator,
    ) -> StepTransaction:
        """The generation's step transaction; the previous one's buffers stop receiving gradients."""
        if self._transaction is not None:
            self._transaction.accum.remove()  # kept parameters must not feed the old buffers
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
        )

    def _switch(
        self, layout: ParallelLayout, groups: ParallelGroups, module: GPTStage, optimizer: MasterAdamW,
        transaction: StepTransaction, *, served: _Held, step: int, keeper: bool,
    ) -> None:
        """Make the new generation's layout, groups, stage, optimizer and transaction current,
        `served` the shards export_shard serves and `step` the next step. The shards dropped stay
        servable (retired) until the next switch; the old groups go to the graveyard. Only a
        `keeper` (its kept gradient sums count in the replayed step) keeps its sums."""
        with self._lock:
            self._retired = {k: v for k, v in self._served.items() if k not in served}
            self._served = served
            if self._groups is not None:
                self._graveyard.append(self._groups)
            self._layout, self._groups, self._module = layout, groups, module
            self._optimizer, self._transaction = optimizer, transaction
            self._prepared = None
            if not keeper:
                self._kept = None
            self.step = step

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
        holdings: HoldingsFn | None = None,
    ) -> ReconfigTimings:
        """Join generation `generation` of `plan` and make `step` the next step to run.

        Kept shards stay in place; missing ones come from `fetch` (with `fetch=None` and
        nothing held, the model is initialised from its seed). The process groups are built
        on `store` under the generation's prefix; `abort` (None: plain waits) is the flag
        every cross-worker wait of this generation's steps checks. `replay`: step `step`
        reuses microbatches kept from its interrupted run (elastic/records/partial.py).
        `holdings`: move shards between the generation's workers over its world group first
        (every worker of the generation joins that exchange); `fetch` gets the rest (shards held
        outside the generation, or that arrived damaged).
        """
        layout = self._check_join(plan, generation, step)
        first, last = layout.layers
        needed = [ShardKey(layer, layout.tp_rank) for layer in range(first, last)]
        with self._lock:
            held = dict(self._served)
        missing = [k for k in needed if k not in held]

        t0 = time.perf_counter()
        self._retire_current()
        groups, skeleton, buffers = self._open_generation(layout, store, abort)
        t1 = time.perf_counter()
        try:
            fetched, over_group = self._gather(layout, groups, missing, held, holdings, fetch)
            step_replay = self._step_replay(layout, groups, replay, step)
            t2 = time.perf_counter()
            accum = buffers.result()
        except BaseException:
            self._graveyard.append(groups)  # an operation of it may be pending: never destroyed
            raise
        module, optimizer, served = self._build_stage(layout, groups, skeleton, needed, held, fetched)
        transaction = self._new_transaction(layout, groups, module, optimizer, step_replay, accum)
        # A keeper keeps its sums until the replayed step commits.
        keeper = step_replay is not None and replay is not None and replay.is_keeper(self.node, self.local_rank)
        self._switch(layout, groups, module, optimizer, transaction, served=served, step=step, keeper=keeper)
        t3 = time.perf_counter()
        replayed = "" if step_replay is None else (
            f", step {step} replays microbatches {list(step_replay.microbatches)} here"
            + (f" and adds kept sums of {sum(len(named) for named in step_replay.sums.values())} parameters in "
               f"blocks {[tuple(b) for b in step_replay.sums]}" if step_replay.sums else "")
        )
        _log(
            f"generation {generation}: rank {layout.rank} (pipeline {layout.pipeline} stage {layout.stage} "
            f"tp {layout.tp_rank}) kept {len(needed) - len(missing)} shards, fetched {len(fetched)} "
            f"({_shard_bytes(fetched)} B) in {t2 - t1:.3f} s, groups in {t1 - t0:.3f} s, stage in "
            f"{t3 - t2:.3f} s{replayed}"
        )
        return ReconfigTimings(
            transfer_s=t2 - t1, rebuild_s=(t1 - t0) + (t3 - t2), bytes_fetched=_shard_bytes(fetched),
            bytes_collective=_shard_bytes({k: v for k, v in fetched.items() if k in over_group}),
        )

    def _gather(
        self, layout: ParallelLayout, groups: ParallelGroups, missing: list[ShardKey], held: _Held,
        holdings: HoldingsFn | None, fetch: FetchFn | None,
    ) -> tuple[dict[ShardKey, ShardState], set[ShardKey]]:
        """The missing shards: over the collective path first (with `holdings`), then `fetch`;
        and which of them came over the process group."""
        fetched = {} if holdings is None else self._exchange(layout, groups, holdings())
        over_group = set(fetched)
        rest = [k for k in missing if k not in fetched]
        if rest and fetch is not None:
            got = fetch(rest)
            absent = sorted(set(rest) - set(got))
            if absent:
                raise ValueError(f"fetch did not return shards {absent}")
            fetched.update({k: got[k] for k in rest})
        elif rest and (held or fetched):
            raise ValueError(f"shards {rest} are not held here and no fetch function was given")
        return fetched, over_group

    def _exchange(
        self, layout: ParallelLayout, groups: ParallelGroups, holdings: dict[int, list[ShardKey]]
    ) -> dict[ShardKey, ShardState]:
        """Send what peers of the generation need from me and receive what I need, over the world
        group (the collective shard path); returns what arrived intact."""
        needs: dict[int, list[ShardKey]] = {}
        for w in assign_ranks(layout.plan):
            first, last = layout.plan.pipelines[w.pipeline].stages[w.stage].layers
            have = set(holdings.get(w.rank, []))
            want = [k for k in (ShardKey(layer, w.tp_rank) for layer in range(first, last)) if k not in have]
            if want:
                needs[w.rank] = want
        holders: dict[ShardKey, list[int]] = {}
        for rank, keys in holdings.items():
            for k in keys:
                holders.setdefault(k, []).append(rank)
        moves = assign_moves(needs, holders)
        if not any(m.src == layout.rank or m.dst == layout.rank for m in moves):
            return {}
        result = exchange(groups.world, rank=layout.rank, moves=moves, export=self._live_shard, wait=groups.wait,
                          device=self.device, post=groups.p2p, fetch=groups.fetch)
        for key, why in sorted(result.failed.items()):
            _log(f"generation {layout.generation}: shard {tuple(key)} did not arrive intact ({why}): "
                 "fetching it over gRPC")
        _log(f"generation {layout.generation}: collective exchange sent {result.bytes_sent} B, received "
             f"{result.bytes_received} B in {result.seconds:.3f} s")
        return dict(result.shards)

    def _live_shard(self, key: ShardKey) -> ShardState:
        """A held shard's own tensors (no copy: nothing updates them while a generation starts)."""
        return self._held_shard(key, copy=False)

    def _retire_current(self) -> None:
        """This worker has left its generation: retire its communicators before the next ones are
        made (aborted if its step was abandoned, NCCL's shut down: elastic/parallel/groups.py),
        and let the device finish what the aborted ones held up (nothing on CPU)."""
        current = self._groups
        if current is not None:
            current.retire()
            synchronize(self.device)

    def _check_join(self, plan: Plan, generation: int, step: int) -> ParallelLayout:
        """My layout in `plan`, after checking that joining generation `generation` at `step` is valid."""
        if self._layout is not None and generation <= self._layout.generation:
            raise ValueError(
                f"generation {generation} is not newer than the current {self._layout.generation}"
            )
        if self._layout is not None and plan.gpus_per_node != self._layout.tp_size:
            raise ValueError(
                f"tensor-parallel degree changes from {self._layout.tp_size} to {plan.gpus_per_node}: "
                "shards of different degrees do not map onto each other"
            )
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return ParallelLayout(plan=plan, generation=generation, node=self.node, local_rank=self.local_rank)

    def _step_replay(
        self, layout: ParallelLayout, groups: ParallelGroups, replay: ReplayRecord | None, step: int
    ) -> StepReplay | None:
        """What this worker computes and adds in step `step` when it replays only part of it;
        kept sums of layers that moved are exchanged here, over the new world group."""
        if replay is None or replay.step != step or not replay.kept:
            return None
        kept = None
        if replay.is_keeper(self.node, self.local_rank):
            kept = self._kept
            if kept is None or kept.step != step or not set(kept.microbatches) <= set(replay.kept):
                raise ValueError(
                    f"generation {layout.generation} counts on this worker's kept sums of step {step}, "
                    f"but it keeps {None if kept is None else (kept.step, list(kept.microbatches))}"
                )
        first, last = layout.layers
        sums: dict[Block, dict[str, torch.Tensor]] = {}
        for block, named in ({} if kept is None else kept.grads).items():
            held = {n: t for n, t in named.items() if first <= self.layer_of(n) < last}
            if held:
                sums.setdefault(block, {}).update(held)
        for block, named in self._moved_sums(layout, groups, replay, kept).items():
            sums.setdefault(block, {}).update(named)
        shares = split_microbatches(layout.plan, replay.missing)
        return StepReplay(step=step, microbatches=shares[layout.pipeline], blocks=replay_blocks(replay, layout.plan),
                          sums=sums, loss_sum=0.0 if kept is None else kept.loss_sum,
                          finite=True if kept is None else kept.finite)

    def _moved_sums(
        self, layout: ParallelLayout, groups: ParallelGroups, replay: ReplayRecord, kept: KeptGrads | None
    ) -> dict[Block, dict[str, torch.Tensor]]:
        """Send my kept sums of layers I no longer hold to their new holders, and receive those
        moved to me (`replay.moved`); block -> canonical name -> sum."""
        ranks = {(w.node, w.local_rank): w.rank for w in assign_ranks(layout.plan)}
        moves = [ShardMove(key=ShardKey(layer, tp), src=ranks[(fn, fr)], dst=ranks[(tn, tr)])
                 for layer, tp, fn, fr, tn, tr in replay.moved]

        def export(key: ShardKey) -> ShardState:
            assert kept is not None, "asked to send kept sums this worker does not keep"
            return {f"grad/{b.start}/{b.size}/{n}": t for b, named in kept.grads.items()
                    for n, t in named.items() if self.layer_of(n) == key.layer}

        out: dict[Block, dict[str, torch.Tensor]] = {}
        for batch in _rounds(moves):  # a holder may get one layer's sums from two keepers: one each round
            if not any(layout.rank in (m.src, m.dst) for m in batch):
                continue
            result = exchange(groups.world, rank=layout.rank, moves=batch, export=export, wait=groups.wait,
                              tag=_SUMS_TAG, device=self.device, post=groups.p2p, fetch=groups.fetch)
            if result.failed:
                raise ValueError(f"kept gradient sums did not arrive intact: {dict(result.failed)}")
            for shard in result.shards.values():
                for key, t in shard.items():
                    _, start, size, name = key.split("/", 3)
                    out.setdefault(Block(int(start), int(size)), {})[name] = t
        return out

    def _build_stage(
        self, layout: ParallelLayout, groups: ParallelGroups, skeleton: GPTStage, needed: list[ShardKey],
        held: _Held, fetched: dict[ShardKey, ShardState],
    ) -> tuple[GPTStage, MasterAdamW, _Held]:
        """The generation's stage module and optimizer, and the shards they serve.

        Only a worker that starts from nothing initialises from the seed. Otherwise the stage is
        `skeleton` (built on the meta device: no memory, no initialisation) with every parameter
        replaced by a kept tensor (the same object, with its AdamW state) or a fetched one
        (adopted as it is when it already has the parameter's device and dtype).
        """
        first, last = layout.layers
        if not held and not fetched:
            module = GPTStage(self.cfg, first=first, last=last, tp=groups.tp, device=self.device)
            optimizer = build_optimizer(module, self.spec.optim)
        else:
            module = skeleton
            states: dict[str, ParamState] = {}
            for name, meta in list(module.named_parameters()):
                key = ShardKey(self.layer_of(name), layout.tp_rank)
                if key in held:
                    param, states[name] = held[key][name]
                else:
                    param, states[name] = _adopt(key, name, meta, fetched[key], self.device)
                _set_parameter(module, name, param)
            optimizer = build_optimizer(module, self.spec.optim, state=states)
        module.train()
        served: _Held = {k: {} for k in needed}
        for name, param in optimizer.params:
            served[ShardKey(self.layer_of(name), layout.tp_rank)][name] = (param, optimizer.state[name])
        return module, optimizer, served

    def export_shard(self, layer: int, tp_rank: int) -> ShardState:
        """The committed state of one held shard as CPU tensors (KeyError if not held).

        Safe to call from other threads at any time: during `start()` it serves the previous
        generation's state until the switch; shards dropped at the last switch stay
        available, at that switch's state, until the next one.
        """
        bind(self.device)  # gRPC's threads call this: no CUDA call of theirs may land on device 0
        return self._held_shard(ShardKey(layer, tp_rank), copy=True)

    def _held_shard(self, key: ShardKey, *, copy: bool) -> ShardState:
        with self._lock:
            entries = self._served.get(key, self._retired.get(key))
            if entries is None:
                raise KeyError(f"shard (layer {key.layer}, tp_rank {key.tp_rank}) is not held by this worker")
            return _export(key, entries, copy=copy)

    # ---- steps ---------------------------------------------------------------------------

    def prepare_step(self, *, halt: bool = False) -> PreparedStep:
        """Run step `self.step` up to the optimizer update (`halt`: vote to stop the generation
        after it); StepAborted or StepDiscarded leave the state unchanged and the gradients
        cleared, VoteCutShort leaves the step `pending`."""
        transaction = self._require()
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
        return None if self._transaction is None else self._transaction.pending

    def commit(self, prepared: PreparedStep) -> StepResult:
        """Apply the prepared step's update (no communication) and advance the step counter."""
        transaction = self._require()
        if prepared is not self._prepared:
            raise ValueError(f"step {prepared.step} is not the step prepared by this trainer")
        with self._lock:
            report = transaction.commit(prepared)
            self._advance(report)
        return report

    def complete_pending(self, *, grad_norm: float, loss: float) -> StepResult:
        """Commit the pending step with its vote's outcome as a peer saw it (see StepTransaction.complete)."""
        transaction = self._require()
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
        if self._closed < len(self._graveyard):
            self._close_retired()
        self._kept = None
        self.step += 1
        self._prepared = None
        self.last_report = report

    def discard(self) -> None:
        """Drop the prepared or pending step's gradients; parameters and optimizer state are unchanged."""
        self._require().discard()
        self._prepared = None

    def evaluate(self) -> float:
        """The validation loss of the committed parameters over `spec.eval_batches` held-out
        microbatches (elastic/engine/eval.py); collective over the generation's world group.
        Only between steps: never while a step is prepared or pending."""
        self._require()
        if self._prepared is not None or self.pending is not None:
            raise RuntimeError(f"step {self.step} is prepared or pending: evaluate between steps only")
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
        """Full fp32 parameters of my stage (collective over my tensor-parallel group)."""
        return full_state_dict(self.module, self.groups.tp)

    def save_outputs(self, reports: list[StepResult], train_seconds: float) -> None:
        """Pipeline 0's stages write their full parameters; rank 0 writes the step results."""
        state = self.full_state()
        layout = self.layout
        if layout.pipeline == 0 and layout.tp_rank == 0:
            path = self.spec.stage_state_path(layout.stage)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)
        if layout.rank == 0:
            result = {
                "steps_committed": self.step,
                "losses": [r.loss for r in reports],
                "grad_norms": [r.grad_norm for r in reports],
                "lrs": [r.lr for r in reports],
                "step_seconds": [r.seconds for r in reports],
                "step_committed_at": [r.committed_at for r in reports],
                "train_seconds": train_seconds,
                "eval_losses": [[step, loss] for step, loss in self.evals],
            }
            self.spec.result_path.write_text(json.dumps(result, indent=1))

    def shutdown(self) -> None:
        """Close the communicators of every generation this trainer joined (the job is over for
        it, or it is dropped): their connections end, and any operation still pending fails."""
        with self._lock:
            every = [*self._graveyard, *([self._groups] if self._groups is not None else [])]
        for groups in every:
            groups.close()

    def close(self) -> None:
        """Wait until every worker of the generation is done with collectives (world barrier)."""
        done = torch.zeros((), device=self.device)
        self.groups.wait(self.groups.world.all_reduce(done))
        self.groups.fetch(done)


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
    trainer.save_outputs(reports, train_seconds)
    trainer.close()
