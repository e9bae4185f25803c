"""What autograd saves in a real `Trainer` step equals the memory model's activation figure, to
the byte, in every recomputation mode and tensor-parallel degree, with sequence parallelism on
and off (issue 54).

Each worker of a one-stage plan runs one real step (tests/engine/test_memory_model.py's
`trained`: Trainers on threads, one gloo world) with the public saved-tensor hooks installed on
its training thread. Every forward of the stage is one microbatch: the hooks count, per forward,
the distinct storages autograd keeps (parameters aside: they are state, not activations). Each
microbatch's count must equal the sum over the stage's planning layers of
`activation_memory.layer_saved` for the mode and the degree, which is the figure the planner's
memory check (`worker_memory`, and through `gpt_layer_counts` the templates) multiplies by the
microbatches in flight.
"""

from __future__ import annotations

import contextlib
import gc
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from elastic.engine.trainer import Trainer
from elastic.model import TensorParallel
from elastic.model.config import RECOMPUTE_MODES, get_preset
from elastic.model.gpt import GPTStage
from elastic.planning.activation_memory import layer_saved, saved_bytes
from elastic.planning.cluster import ClusterSpec, cluster_profile
from elastic.planning.profiler import forward_counting_saved
from tests.comm.support import gloo_comms, on_threads
from tests.engine.test_memory_model import pipelines, shape_of, trained

ROOT = Path(__file__).resolve().parents[2]


def modelled(model: str, *, tp: int, recompute: str, tokens: int, sp: bool = False) -> int:
    """The memory model's activation bytes of one microbatch of a whole-model stage (fp32)."""
    cfg = shape_of(model)
    return sum(saved_bytes(layer_saved(cfg, i, tp, recompute, sp), tokens=tokens, element_bytes=4)
               for i in range(cfg.num_layers))


def counting(per_forward: list[int]) -> object:
    """An `around` for `trained`: count what autograd saves in each forward of the trainer's stage."""

    @contextlib.contextmanager
    def around(trainer: Trainer) -> Iterator[None]:
        params = {p.untyped_storage().data_ptr() for p in trainer.module.parameters()}
        current: dict[int, int] = {}

        def starts(*_: object) -> None:
            current.clear()

        def ends(*_: object) -> None:
            per_forward.append(sum(current.values()))

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                current[storage.data_ptr()] = storage.nbytes()
            return t

        before = trainer.module.register_forward_pre_hook(starts)
        after = trainer.module.register_forward_hook(ends)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            before.remove()
            after.remove()

    return around


def measured(model: str, *, tp: int, recompute: str, microbatches: int, run_dir: Path,
             sp: bool = False) -> dict[int, list[int]]:
    """Per tensor-parallel rank, the bytes each microbatch's forward saved in one real step."""
    cfg = shape_of(model)
    plan = pipelines(cfg.num_layers, [microbatches], mbs=1, tp=tp)
    counts: dict[int, list[int]] = {rank: [] for rank in range(tp)}
    arounds = {rank: counting(counts[rank]) for rank in range(tp)}
    trainers = trained(model, plan, run_dir, recompute=recompute, sequence_parallel=sp,
                       around=lambda trainer: arounds[trainer.layout.tp_rank](trainer))  # type: ignore[operator]
    for trainer in trainers.values():  # gpt2-124m keeps 3.3 GB: free it before the next run
        trainer.shutdown()
    trainers.clear()
    gc.collect()
    return counts


LAYOUTS = [(1, False), (2, False), (2, True)]
"""(tensor-parallel degree, sequence parallelism): nothing to split at TP 1."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("tp", "sp"), LAYOUTS)
@pytest.mark.parametrize("recompute", RECOMPUTE_MODES)
@pytest.mark.parametrize("model", ["tiny", "llama-tiny", "llama-tiny-kv1"])
def test_tiny_saves_what_the_model_counts(tmp_path: Path, recompute: str, tp: int, sp: bool, model: str) -> None:
    cfg = shape_of(model)
    counts = measured(model, tp=tp, recompute=recompute, microbatches=2, run_dir=tmp_path, sp=sp)
    expected = modelled(model, tp=tp, recompute=recompute, tokens=cfg.seq_len, sp=sp)
    for rank, per_forward in counts.items():
        assert per_forward == [expected] * 2, f"tensor-parallel rank {rank}"


@pytest.mark.timeout(120)
def test_the_planner_profile_carries_each_modes_figure() -> None:
    """The planner's layers under each mode (`gpt_layer_counts` -> the derived profile) are the
    same figures at TP 1: what this file measures is what the templates plan with."""
    spec = ClusterSpec(model="tiny", nodes=1, global_batch=2, microbatch=1)
    profile = cluster_profile(spec)
    for mode in RECOMPUTE_MODES:
        planned = sum(layer.under(mode).activation_bytes for layer in profile.layers)
        assert planned == modelled("tiny", tp=1, recompute=mode, tokens=get_preset("tiny").seq_len)


def measured_apart(model: str, *, tp: int, recompute: str, sp: bool, run_dir: Path) -> dict[int, list[int]]:
    """`measured` in a process of its own: gpt2-124m's trainers keep gigabytes that only their
    process's exit gives back (their threads and reference cycles)."""
    code = ("import json, sys; from pathlib import Path; from tests.engine.test_saved_activations import measured; "
            f"print(json.dumps(measured({model!r}, tp={tp}, recompute={recompute!r}, microbatches=1, "
            f"run_dir=Path({str(run_dir)!r}), sp={sp})))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", ["small", pytest.param("gpt2-124m", marks=pytest.mark.soak)])
def test_larger_models_save_what_the_model_counts(tmp_path: Path, model: str) -> None:
    """small and gpt2-124m (sequence 1024), every mode, TP 1 and 2, sequence parallelism on and
    off: one microbatch each, each in a process of its own. gpt2-124m (about 3-5 minutes) is
    `soak`: small runs the same layers, modes and layouts at a sequence of 256."""
    cfg = shape_of(model)
    for tp, sp in LAYOUTS:
        for recompute in RECOMPUTE_MODES:
            counts = measured_apart(model, tp=tp, recompute=recompute, sp=sp, run_dir=tmp_path / f"{tp}-{sp}-{recompute}")
            expected = modelled(model, tp=tp, recompute=recompute, tokens=cfg.seq_len, sp=sp)
            assert counts == {rank: [expected] for rank in range(tp)}, (tp, sp, recompute)

@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index", range(get_preset("tiny").num_layers))
@pytest.mark.parametrize("model", ["tiny", "llama-tiny", "llama-tiny-kv1"])
def test_each_sequence_parallel_layer_saves_what_the_model_counts(dtype: torch.dtype, index: int, model: str) -> None:
    """Layer by layer at TP 2 with sequence parallelism (ranks as threads over real gloo
    communicators), in fp32 and under bf16 autocast (where the column-parallel layers keep
    their fp32 input shard and no weight copy)."""
    cfg = shape_of(model)
    comms = gloo_comms(2, name=f"sp-saved-{model}-{index}-{dtype}")

    def saved(rank: int) -> int:
        torch.manual_seed(0)
        tp = TensorParallel(group=comms[rank], rank=rank, size=2)
        stage = GPTStage(cfg, first=index, last=index + 1, tp=tp, sequence_parallel=True)
        shape = (2, cfg.seq_len // (1 if index == 0 else 2))
        x = (torch.randint(0, cfg.vocab_size, shape) if index == 0
             else torch.randn(*shape, cfg.d_model, requires_grad=True))
        params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            _, count = forward_counting_saved(lambda: stage(x, dropout_key=0), params)
        return count

    try:
        counts = on_threads(2, saved)
    finally:
        for c in comms:
            c.shutdown()
    expected = saved_bytes(layer_saved(cfg, index, 2, sequence_parallel=True), tokens=2 * cfg.seq_len,
                           element_bytes=dtype.itemsize)
    assert counts == [expected, expected]
