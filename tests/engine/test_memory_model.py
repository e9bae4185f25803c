"""The planner's parameter-and-state bytes equal the bytes the engine allocates (issue 31).

Two independent counts: the engine's, by walking everything a `Trainer` references after a real
step and adding up the storages of the tensors it finds (each storage once: views share it),
and the memory model's (`elastic/planning/footprint.py`, through `worker_memory` and the
planner's `StageCosts.state_bytes`), computed from the model's shape and the plan alone. They
must be equal to the byte, for one pipeline (one holder per bucket), several pipelines (the
tree exchange's receive buffers, the partial-replay snapshot), uneven splits (several blocks)
and tensor parallelism; for tiny, small and gpt2-124m. A buffer the engine adds, drops or
resizes breaks this test until the memory model says so too.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
import types
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic.engine.trainer import Trainer
from elastic.model.config import GPTConfig, get_preset
from elastic.planning.cluster import ClusterSpec, cluster_profile
from elastic.planning.footprint import sharded_moment_elements
from elastic.planning.memory import MemoryEstimate, worker_memory
from elastic.records.job import JobSpec
from templates.cost import StageCosts
from templates.plan import PipelinePlan, Plan, StagePlan, even_plan
from tests.engine.runs import OPTIM

_ATOMS = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType)


def engine_bytes(trainer: Trainer) -> dict[int, tuple[int, str]]:
    """Storage -> (bytes, the first path that reaches it) of every tensor `trainer` references,
    through attributes, containers, bound methods, partials and closures (the training data's
    own tensors aside: the corpus is no training state). Meta tensors hold no memory."""
    found: dict[int, tuple[int, str]] = {}
    seen: set[int] = {id(trainer.dataset)}
    stack: list[tuple[Any, str]] = [(trainer, "trainer")]
    while stack:
        obj, path = stack.pop()
        if id(obj) in seen or isinstance(obj, _ATOMS):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                storage = obj.untyped_storage()
                found.setdefault(storage.data_ptr(), (storage.nbytes(), path))
            if obj.grad is not None:
                stack.append((obj.grad, f"{path}.grad"))
            stack.append((getattr(obj, "__dict__", {}), path))  # hooks a parameter holds
            continue
        stack.extend(_referents(obj, path))
    return found


def _referents(obj: Any, path: str) -> list[tuple[Any, str]]:
    if isinstance(obj, dict):
        return [(v, f"{path}.{k}") for k, v in obj.items()] + [(k, f"{path}.<key>") for k in obj]
    if isinstance(obj, list | tuple | set | frozenset | collections.deque):
        return [(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, types.MethodType | types.BuiltinMethodType):
        return [(obj.__self__, f"{path}.__self__"), (getattr(obj, "__func__", None), path)]
    if isinstance(obj, types.FunctionType):
        return [(c.cell_contents, f"{path}.<closure>") for c in obj.__closure__ or () if _filled(c)]
    if isinstance(obj, functools.partial):
        return [(obj.func, path), (obj.args, path), (obj.keywords, path)]
    out: list[tuple[Any, str]] = []
    if hasattr(obj, "__dict__"):
        out.append((vars(obj), path))
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if isinstance(slot, str) and hasattr(obj, slot):
                out.append((getattr(obj, slot), f"{path}.{slot}"))
    return out


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell
        return False
    return True


SHAPES = {"llama-tiny-kv1": ("llama-tiny", get_preset("llama-tiny").with_overrides(n_kv_heads=1)),
          "qwen2-tiny": ("llama-tiny", get_preset("llama-tiny").with_overrides(qkv_bias=True)),
          "qwen2-tiny-kv1": ("llama-tiny", get_preset("llama-tiny").with_overrides(qkv_bias=True, n_kv_heads=1))}
"""Test shapes beside the presets (name -> (preset, shape)): one key/value head, shared by every
tensor-parallel rank (model/kv_layout.py); Qwen2's biases on q, k and v."""


def shape_of(model: str) -> GPTConfig:
    """A preset's or a test shape's config (`SHAPES`)."""
    return SHAPES[model][1] if model in SHAPES else get_preset(model)


def trained(model: str, plan: Plan, run_dir: Path, *, recompute: str = "auto", sequence_parallel: bool | None = None,
            around: Callable[[Trainer], AbstractContextManager[object]] | None = None,
            shard_optimizer: str = "off") -> dict[tuple[int, int], Trainer]:
    """Every worker of `plan` after one real step, each a Trainer on a thread of this process
    (one gloo world on a HashStore), with the partial-replay copy of its sums made as an
    abandoned step makes it (`StepTransaction._keep_partial` -> `accum.snapshot()`); the step
    runs inside `around(trainer)` on the worker's thread when given."""
    preset, shape = SHAPES.get(model, (model, None))
    spec = JobSpec(model=preset, shape=shape, plan=plan, steps=1, run_dir=str(run_dir), optim=OPTIM, device="cpu",
                   recompute=recompute, sequence_parallel=sequence_parallel, shard_optimizer=shard_optimizer)
    store = dist.HashStore()
    out: dict[tuple[int, int], Trainer | BaseException] = {}

    def run(node: int, local_rank: int) -> None:
        try:
            trainer = Trainer(spec, node=node, local_rank=local_rank)
            trainer.start(plan=plan, generation=0, store=store, abort=None, fetch=None, step=0)
            with around(trainer) if around is not None else contextlib.nullcontext():
                trainer.train(1)
            transaction = None if trainer._current is None else trainer._current.transaction
            assert transaction is not None
            if transaction.keep_partial:
                transaction.accum.snapshot()
            out[(node, local_rank)] = trainer
        except BaseException as exc:
            out[(node, local_rank)] = exc

    threads = [threading.Thread(target=run, args=(node, rank)) for node in plan.nodes
               for rank in range(plan.gpus_per_node)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    errors = [v for v in out.values() if isinstance(v, BaseException)]
    done = {k: v for k, v in out.items() if isinstance(v, Trainer)}
    if errors or len(out) != len(threads):
        for trainer in done.values():
            trainer.shutdown()
    assert not errors and len(out) == len(threads), errors or "a worker did not finish its step"
    return done


def modelled(model: str, plan: Plan, trainer: Trainer) -> MemoryEstimate:
    """The memory model's count for `trainer`'s worker, from the plan and the shape alone."""
    layout = trainer.layout
    held = [i for first, last in layout.stage_plan.ranges for i in range(first, last)]
    sharded = sharded_moment_elements(shape_of(model), plan, node=layout.node, layers=held, tp=plan.gpus_per_node)
    return worker_memory(
        shape_of(model), layers=layout.stage_plan.layers, chunks=layout.stage_plan.chunks,
        microbatch_size=plan.microbatch_size, in_flight=1,
        tp=plan.gpus_per_node, holders=len(plan.pipelines), partial_replay=trainer.spec.partial_replay,
        microbatches=[p.microbatches for p in plan.pipelines], pipeline=layout.pipeline, tp_rank=layout.tp_rank,
        moment_elements=sharded if trainer.spec.sharded_optimizer else None,
    )


def assert_same_bytes(model: str, plan: Plan, run_dir: Path, *, shard_optimizer: str = "off",
                      moments_out: dict[tuple[int, int], int] | None = None) -> dict[tuple[int, int], int]:
    """Every worker's engine bytes equal the model's; the engine's bytes by worker (and its
    moments' bytes into `moments_out`)."""
    totals = {}
    trainers = trained(model, plan, run_dir, shard_optimizer=shard_optimizer)
    try:
        for key, trainer in trainers.items():
            found = engine_bytes(trainer)
            engine = sum(nbytes for nbytes, _ in found.values())
            estimate = modelled(model, plan, trainer)
            weights = sum(p.numel() * p.element_size() for p in trainer.module.parameters())
            moments = sum(s.exp_avg.nbytes + s.exp_avg_sq.nbytes for s in trainer.optimizer.state.values())
            assert estimate.state is not None
            by_path = collections.Counter[str]()
            for nbytes, path in found.values():
                by_path[path.split(".<key>")[0].rsplit("[", 1)[0][:80]] += nbytes
            detail = f"worker {key}: model {estimate.state}; engine {by_path.most_common(12)}"
            assert (estimate.state.weights, estimate.state.moments) == (weights, moments), detail
            assert engine == estimate.params_and_state, detail
            totals[key] = engine
            if moments_out is not None:
                moments_out[key] = moments
    finally:  # their gloo groups closed, not left to the rest of the session
        for trainer in trainers.values():
            trainer.shutdown()
    return totals


def pipelines(num_layers: int, split: list[int], *, mbs: int, tp: int = 1) -> Plan:
    """One single-stage pipeline (node p) per entry of `split`, computing that many microbatches."""
    return Plan(num_layers=num_layers, microbatch_size=mbs, gpus_per_node=tp, fault_tolerance=len(split) - 1,
                pipelines=tuple(PipelinePlan(stages=(StagePlan(node=p, layers=(0, num_layers)),), microbatches=m)
                                for p, m in enumerate(split)))


TINY = get_preset("tiny").num_layers


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("split", "tp"),
    [
        ([8], 1),  # one holder, one block of 8: two tree levels of scratch
        ([6], 1),  # one holder, blocks of 4 and 2: a combine scratch
        ([4, 4], 1),  # two holders: receive buffers, the snapshot
        ([3, 2, 2], 1),  # three holders, uneven: several blocks each, padding to 3
        ([8], 2),  # tensor parallel: shards and replicated parameters
        ([4, 4], 2),  # both: only tensor-parallel rank 0 measures the norm in the exchange
    ],
)
def test_tiny_engine_bytes_equal_the_model(tmp_path: Path, split: list[int], tp: int) -> None:
    assert_same_bytes("tiny", pipelines(TINY, split, mbs=2, tp=tp), tmp_path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("model", "tp"), [("llama-tiny", 1), ("llama-tiny", 2), ("llama-tiny-kv1", 2),
                                           ("qwen2-tiny", 1), ("qwen2-tiny", 2), ("qwen2-tiny-kv1", 2)])
def test_llama_tiny_engine_bytes_equal_the_model(tmp_path: Path, model: str, tp: int) -> None:
    """Issue 58: the Llama-family model (no biases, RMSNorm weights, fused q/k/v of grouped-query
    attention, fused gate/up) is counted to the byte too, tensor-parallel or not, with a
    key/value head that both ranks hold, and with Qwen2's q, k and v biases."""
    assert_same_bytes(model, pipelines(shape_of(model).num_layers, [4, 4], mbs=2, tp=tp), tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp", [1, 2])
def test_llama_small_engine_bytes_equal_the_model(tmp_path: Path, tp: int) -> None:
    assert_same_bytes("llama-small", pipelines(get_preset("llama-small").num_layers, [2, 2], mbs=1, tp=tp), tmp_path)


@pytest.mark.timeout(120)
def test_a_multi_stage_plan_counts_each_stage(tmp_path: Path) -> None:
    """Two pipelines of two stages: each worker holds half the layers, buckets of its own."""
    plan = even_plan(num_layers=TINY, nodes=[0, 1, 2, 3], num_pipelines=2, global_microbatches=8, microbatch_size=2)
    totals = assert_same_bytes("tiny", plan, tmp_path)
    assert len(set(totals.values())) == 2  # the two stages differ, the two pipelines do not


@pytest.mark.timeout(120)
def test_interleaved_stages_count_every_chunk(tmp_path: Path) -> None:
    """Two pipelines of two stages, two chunks per stage (issue 53): each worker holds two
    layer ranges, whose buckets break between them."""
    plan = even_plan(num_layers=TINY, nodes=[0, 1, 2, 3], num_pipelines=2, global_microbatches=8, microbatch_size=2,
                     virtual_stages=2)
    assert plan.pipelines[0].virtual_stages == 2
    totals = assert_same_bytes("tiny", plan, tmp_path)
    assert len(set(totals.values())) == 2


def planner_state_bytes(model: str, *, nodes: int, fault_tolerance: int, global_batch: int, mbs: int) -> float:
    """The planner's parameter-and-state bytes of a one-stage worker (a derived profile)."""
    spec = ClusterSpec(model=model, nodes=nodes, fault_tolerance=fault_tolerance, global_batch=global_batch,
                       microbatch=mbs)
    costs = StageCosts(cluster_profile(spec), 1)
    return costs.state_bytes(0, costs.num_layers)


@pytest.mark.timeout(120)
def test_the_planner_counts_what_the_engine_allocates_for_tiny(tmp_path: Path) -> None:
    """One pipeline whose share is one block: the planner's figure is exact. Two pipelines: the
    planner's bound (each bucket's work buffers at their largest) holds, within 5 %."""
    (one,) = assert_same_bytes("tiny", pipelines(TINY, [8], mbs=2), tmp_path / "one").values()
    assert planner_state_bytes("tiny", nodes=1, fault_tolerance=0, global_batch=16, mbs=2) == one
    two = assert_same_bytes("tiny", pipelines(TINY, [4, 4], mbs=2), tmp_path / "two")
    bound = planner_state_bytes("tiny", nodes=2, fault_tolerance=1, global_batch=16, mbs=2)
    assert max(two.values()) <= bound <= 1.05 * max(two.values())


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("model", "microbatches"), [("small", 8), ("gpt2-124m", 1)])
def test_the_planner_counts_what_the_engine_allocates(tmp_path: Path, model: str, microbatches: int) -> None:
    """small (25 M parameters) and gpt2-124m (3.3 GB of state at 20 B per parameter): one worker,
    one real step, every byte accounted for, by the memory model and by the planner."""
    layers = get_preset(model).num_layers
    (engine,) = assert_same_bytes(model, pipelines(layers, [microbatches], mbs=1), tmp_path).values()
    assert planner_state_bytes(model, nodes=1, fault_tolerance=0, global_batch=microbatches, mbs=1) == engine


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_small_two_holders_engine_bytes_equal_the_model(tmp_path: Path) -> None:
    assert_same_bytes("small", pipelines(get_preset("small").num_layers, [2, 2], mbs=1), tmp_path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("pipes", "tp"), [(4, 1), (8, 1), (4, 2)])
def test_sharded_optimizer_bytes_equal_the_model(tmp_path: Path, pipes: int, tp: int) -> None:
    """Issue 55: with the optimizer sharded at f = 1, every worker's bytes still equal the model's,
    and its moments are (f + 1) / P of the unsharded ones (half at P = 4, a quarter at P = 8) up
    to the cuts' 64-element grid."""
    plan = dataclasses.replace(pipelines(TINY, [2] * pipes, mbs=1, tp=tp), fault_tolerance=1)
    full: dict[tuple[int, int], int] = {}
    sharded: dict[tuple[int, int], int] = {}
    assert_same_bytes("tiny", plan, tmp_path / "off", moments_out=full)
    assert_same_bytes("tiny", plan, tmp_path / "on", shard_optimizer="on", moments_out=sharded)
    for key, moments in sharded.items():
        share = moments / full[key]
        print(f"worker {key}: moments {moments} B sharded, {full[key]} B whole: {share:.4f}")
        assert abs(share - 2 / pipes) < 0.01, (key, share)
