"""A job of real Trainers on threads of this process, every communicator recording (the recording
group), through a failure and a re-plan: the logs that `elastic.comm.nccl_model.check` replays.

A case is two generations. Generation 1 runs plan 1 for a step, optionally an evaluation and
a full-state gather (what a run's end and an export do: tensor-parallel all-gathers). Then
nodes fail: their workers post nothing more. With `partial`, the failure comes in the middle
of step 1: the survivors' abort flags are set as the control plane sets them (local in a
pipeline that lost no node, which finishes its microbatches and keeps their sums; hard in one
that did), and the step is abandoned everywhere. Generation 2 runs plan 2 over the survivors
and any spare nodes: shards move over its world communicator from their holders (two-way moves
and rotations among them), kept sums of layers that moved travel too (partial replay), the
step is replayed and one more runs, with an evaluation. Small random models keep a case at a
fraction of a second.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from elastic.comm import Event, Recorder
from elastic.engine.checkpoint.policy import checkpoint_writer_shards
from elastic.engine.checkpoint.slices import CheckpointPart, assemble_parts
from elastic.engine.optim import OptimConfig
from elastic.engine.trainer import Trainer
from elastic.model.config import GPTConfig
from elastic.parallel.abort import AbortSignal, StepAborted
from elastic.parallel.layout import assign_ranks
from elastic.parallel.shard_moves import plan_moves
from elastic.records.job import JobSpec
from elastic.records.partial import ReplayRecord, resolve_replay
from elastic.transfer.shards import ShardKey
from templates.optim_slices import SliceOwnership, plan_owners
from templates.plan import PipelinePlan, Plan, StagePlan

SHAPE = GPTConfig(vocab_size=256, seq_len=8, n_layer=4, n_head=2, d_model=16)
"""6 planning layers (up to 4 stages, or 3 stages of 2 chunks, 2 of 3), a few thousand
parameters: a step takes milliseconds."""
LLAMA_SHAPE = GPTConfig(arch="llama", vocab_size=256, seq_len=8, n_layer=4, n_head=4, n_kv_heads=2, d_model=16,
                        ffn_hidden=32)
"""The Llama family's decoder (model/llama.py) at the same 6 planning layers: grouped-query
attention split by key/value group at TP 2, the fused gate/up, no biases (issue 58)."""
SHARED_KV_SHAPE = dataclasses.replace(LLAMA_SHAPE, n_kv_heads=1, qkv_bias=True)
"""One key/value head, with Qwen2's q, k and v biases: at TP 2 both ranks hold it and sum its
weight's and its biases' gradients, one all-reduce each (model/kv_layout.py)."""
LAYERS = SHAPE.num_layers
OPTIM = OptimConfig(lr=1e-3, warmup_steps=1, eps=1e-6)


@dataclass(frozen=True, kw_only=True)
class Case:
    """One job's communication: two plans and what happens between them."""

    name: str
    plan1: Plan
    plan2: Plan
    failed: frozenset[int] = frozenset()
    """Nodes of plan 1 lost before generation 2 (they post nothing after step 0)."""
    partial: bool = False
    """The failure comes in the middle of step 1 (aborts, kept sums, a replayed step)."""
    evaluate: bool = False
    """Evaluate after each generation's steps (every pipeline forwards held-out microbatches)."""
    recompute: str = "none"
    """What every stage's backward recomputes (model/gpt.py): `full` posts a block's
    tensor-parallel all-reduces again inside the backward."""
    sequence_parallel: bool = True
    """With TP 2, whether the stages run sequence-parallel (model/gpt.py): all-gathers and
    reduce-scatters instead of all-reduces, shards of the sequence between stages."""
    scatter_gather: bool = True
    """With TP 2 and no sequence parallelism, whether each rank sends half of every boundary
    tensor and the receiving node all-gathers it (elastic/parallel/executor.py)."""
    shard_optimizer: bool = False
    """Whether the AdamW moments are sharded over each layer's holders (elastic/engine/optim_shards.py):
    each step starts with the gather of the parameters the other owners updated, generation 2
    re-slices over its world group (optim_repair.py), and the end state is read from the
    checkpoint's parts (optim_checkpoint.py: each slice written once, by one owner, then
    assembled). With a failure, plan 1 has f = 1, so that the loss of one pipeline's nodes leaves
    every slice an owner; otherwise f = 0: P slices of one owner."""
    keep_owners: bool = True
    """Sharded: generation 2's slice owners are the leader's, each survivor kept on the slice that
    overlaps most what it owned (`plan_owners(plan2, previous=...)`); False: plan 2's own."""
    shape: GPTConfig = SHAPE
    """The model: GPT-2's `SHAPE` or the Llama family's `LLAMA_SHAPE`."""


@dataclass
class Outcome:
    """The logs of every worker, and what went wrong on the way (nothing, in a passing case)."""

    logs: dict[tuple[int, int], list[Event]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    steps: dict[tuple[int, int], int] = field(default_factory=dict)
    shards: dict[tuple[int, int], dict[ShardKey, dict[str, torch.Tensor]]] = field(default_factory=dict)
    """Worker -> the shards it holds at the end (parameters, AdamW state, step count)."""
    received: dict[tuple[int, int], int] = field(default_factory=dict)
    parts: dict[tuple[int, int], list[CheckpointPart]] = field(default_factory=dict)
    """Sharded: worker -> its parts of a checkpoint of the end state (heads and slices it writes)."""
    """Worker -> the bytes it received over generation 2's world group as it joined (shard moves
    and the sharded optimizer's repair: `ReconfigTimings.bytes_collective`)."""


def random_plan(rng: random.Random, nodes: Sequence[int], *, tp: int, microbatches: int | None = None) -> Plan:
    """Every node of `nodes` in some pipeline: 1-4 pipelines of random depths (at most 4 stages),
    each of 2 stages or more interleaved with 2 or 3 chunks per stage half the time (as many as
    the layers allow), random contiguous layer splits, random microbatch counts (1-8 each; 1-4
    with tensor parallelism, whose collectives per microbatch make a case slow), or `microbatches`
    split."""
    nodes = list(nodes)
    rng.shuffle(nodes)
    count = rng.randint(1, min(4, len(nodes), microbatches or 4))
    depths = [1] * count
    for _ in range(len(nodes) - count):
        open_ = [p for p in range(count) if depths[p] < 4]
        depths[rng.choice(open_)] += 1
    pipelines = []
    start = 0
    for p, depth in enumerate(depths):
        v = rng.choice([c for c in (1, 1, 2, 3) if depth * c <= LAYERS]) if depth > 1 else 1
        cuts = sorted(rng.sample(range(1, LAYERS), depth * v - 1))
        bounds = [0, *cuts, LAYERS]
        members = nodes[start : start + depth]
        start += depth
        chunks = [tuple((bounds[c * depth + i], bounds[c * depth + i + 1]) for c in range(v)) for i in range(depth)]
        stages = tuple(StagePlan(node=n, layers=chunks[i][0], chunks=chunks[i] if v > 1 else ())
                       for i, n in enumerate(members))
        most = 8 if tp == 1 else 4
        mbs = rng.randint(1, most) if microbatches is None else max(1, microbatches // count + (p < microbatches % count))
        pipelines.append(PipelinePlan(stages=stages, microbatches=mbs))
    return Plan(num_layers=LAYERS, microbatch_size=1, gpus_per_node=tp, fault_tolerance=0, pipelines=tuple(pipelines))


def random_case(seed: int) -> Case:
    """A case drawn from `seed`: plans of up to 4 nodes (8 workers with TP 2), a failure of one
    pipeline's nodes or of none, spares, partial replay, evaluation, a recompute mode, sequence
    parallelism on or off, GPT-2 or Llama (shared key/value heads at TP 2 in some), tied
    embeddings or not."""
    rng = random.Random(seed)
    tp = rng.choice((1, 1, 2))
    nodes = list(range(rng.randint(1, 4 if tp == 1 else 3)))
    plan1 = random_plan(rng, nodes, tp=tp)
    failed: frozenset[int] = frozenset()
    if len(plan1.pipelines) > 1 and rng.random() < 0.7:
        lost = rng.randrange(len(plan1.pipelines))
        stages = plan1.pipelines[lost].stages
        failed = frozenset(rng.sample([s.node for s in stages], rng.randint(1, len(stages))))
    survivors = [n for n in nodes if n not in failed]
    spares = list(range(len(nodes), len(nodes) + rng.randint(0, 1 if len(survivors) < 4 else 0)))
    plan2 = random_plan(rng, survivors + spares, tp=tp, microbatches=plan1.global_microbatches)
    partial = bool(failed) and rng.random() < 0.6
    evaluate = rng.random() < 0.3
    recompute, sequence_parallel = rng.choice(("none", "none", "selective", "full")), rng.random() < 0.5
    scatter_gather, sharded = rng.random() < 0.7, rng.random() < 0.35
    if sharded and failed:  # f = 1: the lost pipeline leaves every slice an owner
        plan1 = dataclasses.replace(plan1, fault_tolerance=1)
    shape = SHAPE  # drawn last: the earlier draws stay each seed's
    if rng.random() < 0.3:
        shape = LLAMA_SHAPE if rng.random() < 0.5 else SHARED_KV_SHAPE
    if rng.random() < 0.25:  # the embedding and the head one matrix: their gradients summed across stages
        shape = dataclasses.replace(shape, tie_embeddings=True)
    return Case(name=f"seed{seed}", plan1=plan1, plan2=plan2, failed=failed, partial=partial, evaluate=evaluate,
                recompute=recompute, sequence_parallel=sequence_parallel, scatter_gather=scatter_gather,
                shard_optimizer=sharded, shape=shape)


Worker = tuple[int, int]
"""(node, local rank)."""


def run_case(case: Case, run_dir: Path, *, timeout_s: float = 60) -> Outcome:
    """Run `case` (module doc) on threads, one per worker; every worker's log, the errors, and
    what each worker of generation 2 holds at the end."""
    return _Job(case, run_dir, timeout_s).run()


class _Job:
    """One case's workers, trainers and logs."""

    def __init__(self, case: Case, run_dir: Path, timeout_s: float) -> None:
        self.case, self.timeout_s = case, timeout_s
        tp = case.plan1.gpus_per_node
        self.spec = JobSpec(model="tiny", shape=case.shape, plan=case.plan1, steps=4, run_dir=str(run_dir), optim=OPTIM,
                            device="cpu", collective_timeout_s=timeout_s, eval_every=100, eval_batches=3,
                            recompute=case.recompute, sequence_parallel=case.sequence_parallel,
                            scatter_gather=case.scatter_gather, shard_optimizer="on" if case.shard_optimizer else "off")
        self.workers = sorted({(n, r) for n in (*case.plan1.nodes, *case.plan2.nodes) for r in range(tp)})
        self.recorders = {w: Recorder(rank=w[0] * tp + w[1]) for w in self.workers}
        self.trainers: dict[Worker, Trainer] = {}
        self.aborts = {w: AbortSignal() for w in self.workers}
        self.live1 = [w for w in self.workers if w[0] in case.plan1.nodes]
        self.survivors = [w for w in self.live1 if w[0] not in case.failed]
        self.live2 = [w for w in self.workers if w[0] in case.plan2.nodes]
        self.stores = [dist.HashStore(), dist.HashStore()]
        self.after_step0 = threading.Barrier(len(self.live1), timeout=timeout_s)
        self.failing = threading.Barrier(max(1, len(self.survivors)), timeout=timeout_s)
        self.replay: ReplayRecord | None = None
        self.holdings: dict[int, list[ShardKey]] = {}
        self.owners: dict[int, SliceOwnership] | None = None
        self.lock = threading.Lock()
        self.out = Outcome()

    def run(self) -> Outcome:
        self._on_threads(self.generation1, self.live1)
        if not self.out.errors:
            self.between()
            self._on_threads(self.generation2, self.live2)
        if self.out.parts and not self.out.errors:  # each shard whole, as its head's writer would read it back
            whole = assemble_parts([p for mine in self.out.parts.values() for p in mine])
            self.out.shards = {w: {p.key: whole[p.key] for p in mine if p.sliced is not None and p.sliced.index is None}
                               for w, mine in self.out.parts.items()}
        self.out.logs = {w: self.recorders[w].snapshot() for w in self.workers}
        for t in self.trainers.values():  # abandoned operations would keep gloo's loops busy
            t.shutdown()
        return self.out

    def trainer(self, w: Worker) -> Trainer:
        with self.lock:
            if w not in self.trainers:
                self.trainers[w] = Trainer(self.spec, node=w[0], local_rank=w[1], recorder=self.recorders[w])
            return self.trainers[w]

    def generation1(self, w: Worker) -> None:
        """Step 0, an evaluation, a full-state gather; then, with `partial`, step 1 abandoned."""
        case, t = self.case, self.trainer(w)
        t.start(plan=case.plan1, generation=1, store=self.stores[0], abort=self.aborts[w], fetch=None, step=0)
        t.commit(t.prepare_step())
        if case.evaluate:
            t.evaluate()
        t.full_state()
        self.after_step0.wait()
        if w[0] in case.failed or not case.partial:
            return  # a failed node posts nothing more; without `partial` the failure comes here
        if self.failing.wait() == 0:  # one survivor sets every survivor's flag, as the control plane does
            for s in self.survivors:
                pipeline = next({st.node for st in p.stages} for p in case.plan1.pipelines
                                if s[0] in {st.node for st in p.stages})
                self.aborts[s].set(f"lost node(s) {sorted(case.failed)}", local=not pipeline & case.failed)
        try:
            t.prepare_step()
        except StepAborted:
            return
        raise AssertionError(f"worker {w}: step 1 was not abandoned")

    def between(self) -> None:
        """What the leader decides: which microbatches are kept, who holds what, who owns which
        optimizer slice."""
        case = self.case
        if case.partial:
            kept = {w: t.kept for w, t in self.trainers.items()}
            reports = [(w[0], w[1], k.report() if (k := kept.get(w)) is not None else None) for w in self.live2]
            self.replay = resolve_replay(case.plan2, reports, step=1)
        held = {k for w, t in self.trainers.items() if w[0] not in case.failed for k in t.holdings()}
        want = {ShardKey(layer, r) for layer in range(LAYERS) for r in range(case.plan1.gpus_per_node)}
        assert held == want, f"{case.name}: shards {sorted(want - held)} have no surviving holder"
        ranks = {(c.node, c.local_rank): c.rank for c in assign_ranks(case.plan2)}
        self.holdings = {ranks[w]: self.trainers[w].holdings() if w in self.trainers else [] for w in self.live2}
        if case.shard_optimizer and case.keep_owners:  # as the leader chooses them (leader_decisions.py)
            self.owners = plan_owners(case.plan2, previous=plan_owners(case.plan1))

    def generation2(self, w: Worker) -> None:
        """Shards moved, step 1 (replayed, with `partial`) and step 2, an evaluation."""
        t, case = self.trainer(w), self.case
        timings = t.start(plan=case.plan2, generation=2, store=self.stores[1], abort=AbortSignal(), fetch=None, step=1,
                          replay=self.replay, moves=plan_moves(case.plan2, self.holdings), owners=self.owners)
        with self.lock:
            self.out.received[w] = timings.bytes_collective
        t.commit(t.prepare_step())
        t.commit(t.prepare_step())
        if self.case.evaluate:
            t.evaluate()
        with self.lock:
            self.out.steps[w] = t.step
            self.out.shards[w] = {k: t.export_shard(*k) for k in t.holdings()}
        if self.case.shard_optimizer:  # holders keep slices of the moments: the checkpoint's parts
            parts = [replace(p, tensors={n: v.clone() for n, v in p.tensors.items()})
                     for p in t.checkpoint_parts(checkpoint_writer_shards(t.layout))]
            with self.lock:
                self.out.parts[w] = parts

    def _on_threads(self, fn: Callable[[Worker], None], workers: list[Worker]) -> None:
        def run(w: Worker) -> None:
            try:
                fn(w)
            except BaseException as exc:  # reported by the test
                with self.lock:
                    self.out.errors.append(f"worker {w}: {type(exc).__name__}: {exc}")

        _on_threads([(run, w) for w in workers], self.timeout_s)


def same_end_state(off: Outcome, on: Outcome) -> None:
    """Every shard (parameters, moments, step count) bit for bit, read sharded from the
    checkpoint's parts (each shard once, assembled from its head and slices, each slice once)."""
    written = {key: state for mine in on.shards.values() for key, state in mine.items()}
    assert written.keys() == {key for mine in off.shards.values() for key in mine}
    for worker, mine in off.shards.items():
        for key, state in mine.items():
            for name, tensor in state.items():
                assert written[key][name].equal(tensor), f"{worker} {key} {name}"


def reference_shards(tp: int, microbatches: int, run_dir: Path, *, steps: int = 3,
                     sequence_parallel: bool = True, shape: GPTConfig = SHAPE) -> dict[ShardKey, dict[str, torch.Tensor]]:
    """Every shard after `steps` steps of one pipeline of one stage on one node (`tp` workers,
    sequence-parallel or not): what any plan, failure and replay must end with, bit for bit
    (the step's summation tree)."""
    plan = Plan(num_layers=LAYERS, microbatch_size=1, gpus_per_node=tp, fault_tolerance=0,
                pipelines=(PipelinePlan(stages=(StagePlan(node=0, layers=(0, LAYERS)),), microbatches=microbatches),))
    spec = JobSpec(model="tiny", shape=shape, plan=plan, steps=4, run_dir=str(run_dir), optim=OPTIM, device="cpu",
                   eval_every=100, eval_batches=3, sequence_parallel=sequence_parallel)
    store = dist.HashStore()
    out: dict[ShardKey, dict[str, torch.Tensor]] = {}
    lock = threading.Lock()

    def run(w: Worker) -> None:
        t = Trainer(spec, node=0, local_rank=w[1])
        t.start(plan=plan, generation=1, store=store, abort=None, fetch=None, step=0)
        t.train(steps)
        with lock:
            out.update({k: t.export_shard(*k) for k in t.holdings()})
        t.shutdown()

    _on_threads([(run, (0, r)) for r in range(tp)], 60)
    return out


def _on_threads(jobs: list[tuple[Callable[[Worker], None], Worker]], timeout_s: float) -> None:
    threads = [threading.Thread(target=fn, args=(w,), name=f"worker{w[0]}.{w[1]}", daemon=True) for fn, w in jobs]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s  # one deadline for all: N stuck threads cost timeout_s, not N times it
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"threads still running after {timeout_s} s: {stuck}"
