"""The memory model (elastic/planning/footprint.py, sum_tree.py, activation_memory.py,
planner_figures.py, memory.py) as units: its mirrors of the
engine's bucketing, summation tree and parameter shapes against the engine's own functions, its
one per-parameter formula against its exact count, its activation counts against the tensors
autograd saves, and the planner's figures against the exact count they bound. The whole against
the engine's real allocations is tests/engine/test_memory_model.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.model.config import PRESETS, RECOMPUTE_MODES, GPTConfig, get_preset
from elastic.model.gpt import GPTStage
from elastic.model.naming import layer_of
from elastic.model.tensor_parallel import TensorParallel
from elastic.parallel.blocks import Block, CombineProgram, decompose
from elastic.parallel.buckets import split_layers
from elastic.planning.activation_memory import layer_saved, saved_bytes
from elastic.planning.cluster import ClusterSpec, cluster_profile
from elastic.planning.footprint import (
    LOSS_BYTES,
    NORM_BYTES,
    NORM_CHUNK,
    RESERVE_BYTES,
    STEP_COUNT_BYTES,
    GradShare,
    bucket_runs,
    grad_bytes_per_param,
    layer_elements,
    state_bytes,
    state_bytes_per_param,
)
from elastic.planning.memory import worker_memory
from elastic.planning.planner_figures import holder_figures, planner_figures
from elastic.planning.profiler import forward_counting_saved
from elastic.planning.sum_tree import combine_scratch, disjoint_scratch, tree_blocks, tree_scratch
from templates.cost import StageCosts

pytestmark = pytest.mark.timeout(60)


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(1, 40), min_size=0, max_size=5, unique=True), total=st.integers(1, 41))
def test_the_summation_tree_mirrors_the_engines(cuts: list[int], total: int) -> None:
    bounds = [0, *sorted(c for c in cuts if c < total), total]
    blocks = [b for a, z in zip(bounds, bounds[1:], strict=False) for b in tree_blocks(a, z - a)]
    for a, z in zip(bounds, bounds[1:], strict=False):
        assert [tuple(b) for b in decompose(range(a, z))] == list(tree_blocks(a, z - a))
    assert combine_scratch(blocks) == CombineProgram([Block(*b) for b in blocks]).scratch


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 5), min_size=1, max_size=40), gaps=st.lists(st.integers(0, 3), max_size=40))
def test_the_one_pass_count_of_disjoint_blocks_is_the_tree_walks(sizes: list[int], gaps: list[int]) -> None:
    """Disjoint aligned blocks in order, with gaps between some (a holder's own blocks): the
    one-pass count the planner uses equals the walk of the tree, and the engine's program."""
    blocks: list[tuple[int, int]] = []
    start = 0
    for i, exp in enumerate(sizes):
        size = 1 << exp
        start = -(-(start + (gaps[i] if i < len(gaps) else 0)) // size) * size  # aligned
        blocks.append((start, size))
        start += size
    assert disjoint_scratch(tuple(blocks)) == tree_scratch(tuple(blocks))
    assert combine_scratch(blocks) == CombineProgram([Block(*b) for b in blocks]).scratch


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 12_000_000), min_size=1, max_size=12))
def test_the_buckets_mirror_the_engines(sizes: list[int]) -> None:
    layers = tuple(range(len(sizes)))
    names = [f"p{i}" for i in layers]
    runs = split_layers(layers, names, lambda n: int(n[1:]), {n: s for n, s in zip(names, sizes, strict=True)})
    assert bucket_runs(sizes) == [sum(sizes[i] for i in run) for run in reversed(runs)]


def _presets() -> Iterator[tuple[str, int]]:
    for name, cfg in PRESETS.items():
        for tp in (1, 2, 4):
            if cfg.n_head % tp == 0 and cfg.vocab_size % tp == 0:
                yield name, tp


@pytest.mark.parametrize(("name", "tp"), list(_presets()))
def test_layer_elements_are_the_modules(name: str, tp: int) -> None:
    cfg = get_preset(name)
    group = None if tp == 1 else cast(Any, object())  # shapes only: no collective runs on the meta device
    with torch.device("meta"):
        for rank in range(tp):
            stage = GPTStage(cfg, tp=TensorParallel(group=group, rank=rank, size=tp), initialise=False)
            per_layer = [0] * cfg.num_layers
            for pname, p in stage.named_parameters():
                per_layer[layer_of(pname, cfg)] += p.numel()
            assert per_layer == [layer_elements(cfg, i, tp) for i in range(cfg.num_layers)]


@pytest.mark.parametrize("split", [[1], [8], [6], [4, 4], [3, 2, 2], [5, 3], [16, 16, 16, 16]])
@pytest.mark.parametrize("partial_replay", [False, True])
def test_the_per_parameter_formula_is_the_exact_count_without_padding(split: list[int], partial_replay: bool) -> None:
    """Buckets whose sizes divide by the holder count: the exact count is the one formula times
    the parameters, plus the fixed work buffers."""
    p = len(split)
    layers = [3 * 2**20 * p, 5 * p, 7 * 2**20 * p]  # a bucket per layer beyond 1 MiB, all divisible by p
    for me in range(p):
        share = GradShare.of_split(split, me=me, partial_replay=partial_replay)
        exact = state_bytes(layers, share)
        work = exact.work
        assert exact.total == pytest.approx(sum(layers) * state_bytes_per_param(share) + work, rel=0, abs=0.5)
        if p == 1 and len(share.blocks) == 1:  # no combine: only the norm's chunk, the step count
            assert work == NORM_BYTES * NORM_CHUNK + STEP_COUNT_BYTES


def test_one_pipeline_of_a_power_of_two_is_20_to_28_bytes_per_parameter() -> None:
    assert [state_bytes_per_param(GradShare.of_split([m])) for m in (1, 2, 4, 8, 16)] == [20, 20, 24, 28, 32]
    two = GradShare.of_split([4, 4], partial_replay=True)  # a receive buffer of half, a snapshot
    assert state_bytes_per_param(two) == 4 + 8 + 4 * (1 + 1 + 1 + 1) + 4 * 1 / 2


@settings(max_examples=150, deadline=None)
@given(
    layers=st.lists(st.integers(1, 9_000_000), min_size=1, max_size=8),
    microbatches=st.integers(1, 24),
    pipelines=st.integers(1, 4),
    device_type=st.sampled_from(["cpu", "cuda"]),
)
def test_the_planner_figures_bound_the_exact_count(
    layers: list[int], microbatches: int, pipelines: int, device_type: str
) -> None:
    """For an even split of the step over 1..P pipelines, the planner's figures (per parameter,
    per worker) are at least every worker's exact bytes; exact for one pipeline of one block."""
    figures = planner_figures(global_microbatches=microbatches, max_pipelines=pipelines, device_type=device_type)
    n = sum(layers)
    planned = n * (4 + 8 + figures.grad_bytes_per_param) + figures.worker_bytes
    for p in range(1, min(pipelines, microbatches) + 1):
        split = [microbatches // p + (1 if i < microbatches % p else 0) for i in range(p)]
        for me in range(p):
            exact = state_bytes(layers, GradShare.of_split(split, me=me, partial_replay=True), device_type)
            assert exact.total <= planned + 1e-6 * planned
    if pipelines == 1 and microbatches & (microbatches - 1) == 0 and device_type == "cpu":
        share = GradShare.of_split([microbatches])
        assert planned == state_bytes(layers, share).total
        assert figures.grad_bytes_per_param == grad_bytes_per_param(share)


@settings(max_examples=60, deadline=None)
@given(
    microbatches=st.integers(1, 300),
    low=st.integers(1, 40),
    span=st.integers(0, 80),
    partial_replay=st.booleans(),
    device_type=st.sampled_from(["cpu", "cuda"]),
)
def test_the_planner_figures_are_the_largest_over_every_holder(
    microbatches: int, low: int, span: int, partial_replay: bool, device_type: str
) -> None:
    """planner_figures asks one holder of each kind per plan (a plan of P pipelines costs a few
    shares, not P): the same figures, exactly, as asking every holder of every even split."""
    low = min(low, microbatches)  # at most one pipeline per microbatch
    figures = planner_figures(global_microbatches=microbatches, min_pipelines=low, max_pipelines=low + span,
                              partial_replay=partial_replay, device_type=device_type)
    grad, worker = 0.0, 0
    for p in range(low, max(low, min(low + span, microbatches)) + 1):
        split = [microbatches // p + (1 if i < microbatches % p else 0) for i in range(p)]
        for me in range(p):
            one = holder_figures(GradShare.of_split(split, me=me, partial_replay=partial_replay), device_type)
            grad, worker = max(grad, one.grad_bytes_per_param), max(worker, one.worker_bytes)
    assert (figures.grad_bytes_per_param, figures.worker_bytes) == (grad, worker)


CFG = GPTConfig(vocab_size=512, seq_len=64, n_layer=2, n_head=4, d_model=128)
"""A model small enough to count what each of its layers saves for backward."""


def _saved(stage: GPTStage, x: torch.Tensor, dtype: torch.dtype) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in `stage`'s forward."""
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        _, saved = forward_counting_saved(lambda: stage(x, dropout_key=0), params)
    return saved


@pytest.mark.parametrize("recompute", RECOMPUTE_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index", range(CFG.num_layers))
def test_activation_counts_are_what_autograd_saves(dtype: torch.dtype, index: int, recompute: str) -> None:
    """Each layer's saved bytes, in fp32 and under bf16 autocast (the CPU's, which casts these
    layers' matmuls and attention as CUDA's does; CUDA's fused attention kernels may keep a few
    bytes per token more or less than the CPU's), in every recompute mode: `full` keeps a block's
    input alone."""
    torch.manual_seed(0)
    stage = GPTStage(CFG, first=index, last=index + 1, recompute=recompute)
    shape = (2, CFG.seq_len)
    x = torch.randint(0, CFG.vocab_size, shape) if index == 0 else torch.randn(*shape, CFG.d_model, requires_grad=True)
    expected = saved_bytes(layer_saved(CFG, index, recompute=recompute), tokens=2 * CFG.seq_len,
                           element_bytes=dtype.itemsize)
    assert _saved(stage, x, dtype) == expected
    if recompute == "full" and CFG.layer_kind(index) == "block":
        assert expected == x.numel() * x.element_size()


def test_worker_memory_parts() -> None:
    cfg = get_preset("gpt2-124m")
    last = cfg.num_layers
    gpu = worker_memory(cfg, layers=(0, last), microbatch_size=8, in_flight=1, compute_dtype=torch.bfloat16,
                        device_type="cuda", microbatches=8)
    cpu = worker_memory(cfg, layers=(0, last), microbatch_size=8, in_flight=1, microbatches=8)
    assert gpu.reserve == RESERVE_BYTES["cuda"] and cpu.reserve == 0
    tokens = 8 * cfg.seq_len
    assert cpu.head == tokens * cfg.vocab_size * 16  # logits, shifted, exp, softmax: fp32 each
    assert gpu.head == tokens * cfg.vocab_size * 18  # bf16 logits and their fp32 copy besides
    assert gpu.activations < cpu.activations
    # One slice-long combine scratch per bucket on an accelerator, SUM_CHUNK-long ones on CPU; no
    # float64 chunk for the norm there.
    assert gpu.params_and_state == cpu.params_and_state - NORM_BYTES * NORM_CHUNK
    first = worker_memory(cfg, layers=(0, 4), microbatch_size=8, in_flight=3)
    assert first.head == 0
    assert first.activations == 3 * worker_memory(cfg, layers=(0, 4), microbatch_size=8, in_flight=1).activations
    replay = worker_memory(cfg, layers=(0, 4), microbatch_size=8, in_flight=1, holders=2, partial_replay=True)
    assert replay.state is not None and replay.state.work >= LOSS_BYTES


def test_a_cuda_cluster_plans_bf16_activations_and_a_reserve() -> None:
    def spec(device_type: str) -> ClusterSpec:
        return ClusterSpec(model="gpt2-124m", nodes=2, global_batch=16, microbatch=8, device_memory_gib=80.0,
                           device_type=device_type)

    cpu, gpu = cluster_profile(spec("cpu")), cluster_profile(spec("cuda"))
    assert cpu.device.reserve_bytes == 0 and gpu.device.reserve_bytes == RESERVE_BYTES["cuda"]
    assert gpu.device.budget_bytes == 80 * 2**30 - RESERVE_BYTES["cuda"]
    blocks = zip(gpu.layers[1:-1], cpu.layers[1:-1], strict=True)
    assert all(g.activation_bytes < c.activation_bytes for g, c in blocks)  # the head keeps a bf16 weight copy
    assert gpu.layers[-1].workspace_bytes == 8 * 1024 * 50304 * 18
    assert StageCosts(gpu, 1).capacity < StageCosts(cpu, 1).capacity
    with pytest.raises(ValueError, match="device type must be one of"):
        spec("tpu")
