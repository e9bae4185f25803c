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

import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from elastic.comm import Event, Recorder
from elastic.engine.optim import OptimConfig
from elastic.engine.trainer import Trainer
from elastic.model.config import GPTConfig
from elastic.parallel.abort import AbortSignal, StepAborted
from elastic.parallel.layout import assign_ranks
from elastic.records.job import JobSpec
from elastic.records.partial import resolve_replay
from elastic.transfer.shards import ShardKey
from templates.plan import PipelinePlan, Plan, StagePlan

SHAPE = GPTConfig(vocab_size=256, seq_len=8, n_layer=2, n_head=2, d_model=16)
"""4 planning layers (up to 4 stages), a few thousand parameters: a step takes milliseconds."""
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


@dataclass
class Outcome:
    """The logs of every worker, and what went wrong on the way (nothing, in a passing case)."""

    logs: dict[tuple[int, int], list[Event]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    steps: dict[tuple[int, int], int] = field(default_factory=dict)
    shards: dict[tuple[int, int], dict[ShardKey, dict[str, torch.Tensor]]] = field(default_factory=dict)
    """Worker -> the shards it holds at the end (parameters, AdamW state, step count)."""


def random_plan(rng: random.Random, nodes: Sequence[int], *, tp: int, microbatches: int | None = None) -> Plan:
    """Every node of `nodes` in some pipeline: 1-4 pipelines of random depths (at most 4 stages),
    random contiguous layer splits, random microbatch counts (1-8 each; 1-4 with tensor
    parallelism, whose collectives per microbatch make a case slow), or `microbatches` split."""
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
        cuts = sorted(rng.sample(range(1, LAYERS), depth - 1))
        bounds = [0, *cuts, LAYERS]
        members = nodes[start : start + depth]
        start += depth
        stages = tuple(StagePlan(node=n, layers=(bounds[i], bounds[i + 1])) for i, n in enumerate(members))
        most = 8 if tp == 1 else 4
        mbs = rng.randint(1, most) if microbatches is None else max(1, microbatches // count + (p < microbatches % count))
        pipelines.append(PipelinePlan(stages=stages, microbatches=mbs))
    return Plan(num_layers=LAYERS, microbatch_size=1, gpus_per_node=tp, fault_tolerance=0, pipelines=tuple(pipelines))


def random_case(seed: int) -> Case:
    """A case drawn from `seed`: plans of up to 4 nodes (8 workers with TP 2), a failure of one
    pipeline's nodes or of none, spares, partial replay, evaluation."""
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
    return Case(name=f"seed{seed}", plan1=plan1, plan2=plan2, failed=failed, partial=partial,
                evaluate=rng.random() < 0.3)


def run_case(case: Case, run_dir: Path, *, timeout_s: float = 60) -> Outcome:
    """Run `case` (module doc) on threads, one per worker; every worker's log."""
    tp = case.plan1.gpus_per_node
    spec = JobSpec(model="tiny", shape=SHAPE, plan=case.plan1, steps=4, run_dir=str(run_dir), optim=OPTIM,
                   device="cpu", collective_timeout_s=timeout_s, eval_every=100, eval_batches=3)
    workers = sorted({(n, r) for n in (*case.plan1.nodes, *case.plan2.nodes) for r in range(tp)})
    recorders = {w: Recorder(rank=w[0] * tp + w[1]) for w in workers}
    trainers: dict[tuple[int, int], Trainer] = {}
    aborts1 = {w: AbortSignal() for w in workers}
    out = Outcome()
    live1 = [w for w in workers if w[0] in case.plan1.nodes]
    survivors = [w for w in live1 if w[0] not in case.failed]
    live2 = [w for w in workers if w[0] in case.plan2.nodes]
    barrier1 = threading.Barrier(len(live1), timeout=timeout_s)
    barrier_s = threading.Barrier(len(survivors), timeout=timeout_s) if survivors else None
    lock = threading.Lock()
    stores = [dist.HashStore(), dist.HashStore()]
    replay_box: list[object] = []
    gen2_ready = threading.Event()

    def trainer(w: tuple[int, int]) -> Trainer:
        with lock:
            if w not in trainers:
                trainers[w] = Trainer(spec, node=w[0], local_rank=w[1], recorder=recorders[w])
            return trainers[w]

    def generation1(w: tuple[int, int]) -> None:
        t = trainer(w)
        t.start(plan=case.plan1, generation=1, store=stores[0], abort=aborts1[w], fetch=None, step=0)
        t.commit(t.prepare_step())
        if case.evaluate:
            t.evaluate()
        t.full_state()
        barrier1.wait()
        if w[0] in case.failed or not case.partial:
            return
        assert barrier_s is not None
        if barrier_s.wait() == 0:  # one survivor sets every survivor's flag, as the control plane does
            for s in survivors:
                pipeline = {st.node for p in case.plan1.pipelines for st in p.stages if s[0] in {x.node for x in p.stages}}
                aborts1[s].set(f"lost node(s) {sorted(case.failed)}", local=not (pipeline & case.failed))
        try:
            t.prepare_step()
        except StepAborted:
            return
        raise AssertionError(f"worker {w}: step 1 was not abandoned")

    def generation2(w: tuple[int, int]) -> None:
        gen2_ready.wait(timeout_s)
        t = trainer(w)
        replay = replay_box[0] if replay_box else None
        ranks = {(c.node, c.local_rank): c.rank for c in assign_ranks(case.plan2)}
        holdings = {ranks[v]: trainers[v].holdings() if v in trainers else [] for v in live2}
        t.start(plan=case.plan2, generation=2, store=stores[1], abort=AbortSignal(), fetch=None, step=1,
                replay=replay, holdings=lambda: holdings)  # type: ignore[arg-type]
        t.commit(t.prepare_step())
        t.commit(t.prepare_step())
        if case.evaluate:
            t.evaluate()
        with lock:
            out.steps[w] = t.step
            out.shards[w] = {k: t.export_shard(*k) for k in t.holdings()}

    def run(fn: object, w: tuple[int, int]) -> None:
        try:
            fn(w)  # type: ignore[operator]
        except BaseException as exc:  # reported by the test
            with lock:
                out.errors.append(f"worker {w}: {type(exc).__name__}: {exc}")

    _on_threads([(generation1, w) for w in live1], run, timeout_s)
    if out.errors:
        out.logs = {w: recorders[w].snapshot() for w in workers}
        for t in trainers.values():
            t.shutdown()
        return out
    if case.partial:
        reports = [(w[0], w[1], trainers[w].kept.report() if w in trainers and trainers[w].kept else None)
                   for w in live2]
        replay_box.append(resolve_replay(case.plan2, reports, step=1))
    else:  # the failure came between steps: generation 1 committed step 0 only, every survivor holds it
        pass
    _hold_every_shard(case, trainers)
    gen2_ready.set()
    _on_threads([(generation2, w) for w in live2], run, timeout_s)
    out.logs = {w: recorders[w].snapshot() for w in workers}
    for t in trainers.values():  # abandoned operations would keep gloo's loops busy for the next cases
        t.shutdown()
    return out


def reference_shards(tp: int, microbatches: int, run_dir: Path, *, steps: int = 3) -> dict[ShardKey, dict[str, torch.Tensor]]:
    """Every shard after `steps` steps of one pipeline of one stage on one node (`tp` workers):
    what any plan, failure and replay must end with, bit for bit (the step's summation tree)."""
    plan = Plan(num_layers=LAYERS, microbatch_size=1, gpus_per_node=tp, fault_tolerance=0,
                pipelines=(PipelinePlan(stages=(StagePlan(node=0, layers=(0, LAYERS)),), microbatches=microbatches),))
    spec = JobSpec(model="tiny", shape=SHAPE, plan=plan, steps=4, run_dir=str(run_dir), optim=OPTIM, device="cpu",
                   eval_every=100, eval_batches=3)
    store = dist.HashStore()
    out: dict[ShardKey, dict[str, torch.Tensor]] = {}
    lock = threading.Lock()

    def run(w: tuple[int, int]) -> None:
        t = Trainer(spec, node=0, local_rank=w[1])
        t.start(plan=plan, generation=1, store=store, abort=None, fetch=None, step=0)
        t.train(steps)
        with lock:
            out.update({k: t.export_shard(*k) for k in t.holdings()})
        t.shutdown()

    _on_threads([(run, (0, r)) for r in range(tp)], lambda fn, w: fn(w), 60)
    return out


def _hold_every_shard(case: Case, trainers: dict[tuple[int, int], Trainer]) -> None:
    """Every shard of the model is held by a survivor (a case whose failure lost a layer's every
    holder would fall back to a checkpoint, which moves nothing over the communicators)."""
    held = {k for w, t in trainers.items() if w[0] not in case.failed for k in t.holdings()}
    want = {ShardKey(layer, r) for layer in range(LAYERS) for r in range(case.plan1.gpus_per_node)}
    assert held == want, f"{case.name}: shards {sorted(want - held)} have no surviving holder"


def _on_threads(jobs: list[tuple[object, tuple[int, int]]], run: object, timeout_s: float) -> None:
    threads = [threading.Thread(target=run, args=job, name=f"worker{job[1][0]}.{job[1][1]}", daemon=True)
               for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"threads still running after {timeout_s} s: {stuck}"
