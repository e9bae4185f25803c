"""The measuring half of `elastic profile`: time every planning layer of a GPT on this device.

Each layer is built alone as a `GPTStage(cfg, first=i, last=i+1)` and, per microbatch, timed
for forward and, separately, for backward (the gradient of a random upstream gradient, so the
backward is measured, never assumed to be a multiple of forward); the median of the repeats
is kept. The forward runs in the engine's compute dtype (`memory.compute_dtype`: under bf16
autocast on CUDA, as the engine's forward does; fp32 on the CPU). Activation bytes are the
tensors autograd saves for backward (counted through the public saved-tensor hooks, each
storage once: under autocast the bf16 copies of the weights included). Parameter bytes are the
module's; optimizer bytes assume AdamW's two fp32 moments per parameter; the head's loss
workspace, the device's reserve and the engine's buffers come from the memory model
(`footprint.py`). Link costs are not measured here: they keep `templates.derive.DeviceSpeed`'s
defaults, which the profile notes say.

Models too large to run here get a profile derived from FLOP/byte counts, scaled by the
measured matmul speed of this device in the compute dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import statistics
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from elastic.model.config import GPTConfig
from elastic.model.gpt import Block, GPTStage
from elastic.planning.activation_memory import head_bytes, rerun_allreduces
from elastic.planning.footprint import GradShare, reserve_bytes, state_bytes_per_param
from elastic.planning.memory import compute_dtype, device_memory_bytes
from elastic.planning.planner_figures import planner_figures
from templates.derive import ADAMW_STATE_PER_PARAM, DeviceSpeed, LayerCounts, derive_profile
from templates.profile import LayerProfile, MemoryModel, Profile, RecomputeCost

_T = TypeVar("_T")

# Measure only models whose training state uses at most this share of the memory budget.
_MEASURE_MEMORY_SHARE = 0.25
# ... and whose forward + backward of one microbatch is estimated below this many seconds.
_MEASURE_MAX_SECONDS = 20.0


@dataclass(frozen=True, kw_only=True)
class ProfilerConfig:
    """What to measure and how."""

    microbatch: int
    """Samples per microbatch."""
    device: torch.device
    """Where to run the layers."""
    memory_bytes: int
    """Memory of one device to write into the profile (its reserve comes off it)."""
    warmup: int = 1
    """Untimed runs per layer before timing."""
    repeats: int = 3
    """Timed runs per layer; the median is kept."""


def default_memory_bytes(device: torch.device) -> int:
    """Total memory of `device` (host RAM for the CPU); the profile's reserve comes off it."""
    return device_memory_bytes(device)


def matmul_flops_per_second(device: torch.device, size: int = 512, repeats: int = 5) -> float:
    """Achieved FLOP/s of a square matmul in the compute dtype on `device` (best of `repeats`)."""
    dtype = compute_dtype(device)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def should_measure(cfg: GPTConfig, counts: list[LayerCounts], conf: ProfilerConfig, flops: float) -> bool:
    """Whether the model is small enough to run layer by layer on this device."""
    state = sum(c.params for c in counts) * state_bytes_per_param(GradShare.of_split([1]))
    seconds = 3 * sum(c.flops_per_token for c in counts) * cfg.seq_len * conf.microbatch / flops
    return state <= _MEASURE_MEMORY_SHARE * conf.memory_bytes and seconds <= _MEASURE_MAX_SECONDS


def measure_profile(name: str, cfg: GPTConfig, counts: list[LayerCounts], conf: ProfilerConfig) -> Profile:
    """Time every planning layer of `cfg` on `conf.device`."""
    if len(counts) != cfg.num_layers:
        raise ValueError(f"{len(counts)} layer descriptions for {cfg.num_layers} planning layers")
    torch.manual_seed(0)
    layers = [_measure_layer(cfg, i, counts[i].tp_allreduces, conf) for i in range(cfg.num_layers)]
    element = compute_dtype(conf.device).itemsize
    loss = head_bytes(cfg, tokens=conf.microbatch * cfg.seq_len, element_bytes=element)
    layers[-1] = dataclasses.replace(layers[-1], workspace_bytes=loss)
    speed = DeviceSpeed(flops_per_second=1.0, memory_bytes=conf.memory_bytes, reserve_bytes=reserve_bytes(conf.device.type))
    notes = (
        f"measured on {conf.device} ({torch.get_num_threads()} threads), {_precision(conf.device)}, median of "
        f"{conf.repeats}; backward timed separately; optimizer = AdamW fp32 moments (8 B/param); activations = "
        f"tensors saved for backward; recomputation: what each mode keeps, counted the same way, and the attention core and the block forward it reruns; link costs are defaults, not measured"
    )
    return Profile(
        model=name,
        microbatch_size=conf.microbatch,
        layers=tuple(layers),
        device=speed.device_profile(),
        source="measured",
        notes=notes,
        memory=_one_pipeline(),
    )


def _one_pipeline() -> MemoryModel:
    """The engine's buffers for one pipeline of one block: a cluster replaces them with its own."""
    figures = planner_figures(global_microbatches=1)
    return MemoryModel(grad_bytes_per_param=figures.grad_bytes_per_param, worker_bytes=figures.worker_bytes)


def _precision(device: torch.device) -> str:
    dtype = compute_dtype(device)
    return "fp32" if dtype == torch.float32 else f"{str(dtype).removeprefix('torch.')} autocast"


def _autocast(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """The engine's forward precision on `device` (`engine/device.py` compute_precision)."""
    dtype = compute_dtype(device)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def derived_from_speed(
    name: str, cfg: GPTConfig, counts: list[LayerCounts], conf: ProfilerConfig, flops: float
) -> Profile:
    """FLOP/byte counts scaled by the measured matmul speed `flops` of this device."""
    device = DeviceSpeed(
        flops_per_second=flops,
        memory_bytes=conf.memory_bytes,
        reserve_bytes=reserve_bytes(conf.device.type),
        description=f"measured {_precision(conf.device).split()[0]} matmul speed of {conf.device}; model too "
        f"large to run here",
    )
    element = compute_dtype(conf.device).itemsize
    profile = derive_profile(
        model=name, layers=counts, seq_len=cfg.seq_len, microbatch_size=conf.microbatch, device=device,
        compute_bytes=element,
    )
    return dataclasses.replace(profile, memory=_one_pipeline())


def _measure_layer(cfg: GPTConfig, index: int, tp_allreduces: int, conf: ProfilerConfig) -> LayerProfile:
    stage = GPTStage(cfg, first=index, last=index + 1, device=conf.device)
    shape = (conf.microbatch, cfg.seq_len)
    if index == 0:
        x = torch.randint(0, cfg.vocab_size, shape, device=conf.device)  # (batch, seq)
    else:
        x = torch.randn(*shape, cfg.d_model, device=conf.device, requires_grad=True)  # (batch, seq, d_model)

    def forward() -> torch.Tensor:
        with _autocast(conf.device):
            return stage(x, dropout_key=index)

    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    fwd: list[float] = []
    bwd: list[float] = []
    saved = 0
    for run in range(conf.warmup + conf.repeats):
        stage.zero_grad(set_to_none=True)
        elapsed, (out, saved) = _timed(conf.device, lambda: forward_counting_saved(forward, params))
        upstream = torch.randn_like(out)
        back, _ = _timed(conf.device, functools.partial(out.backward, upstream))
        if run >= conf.warmup:
            fwd.append(elapsed)
            bwd.append(back)
    param_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
    modes = _recompute_costs(cfg, index, conf, x, forward=statistics.median(fwd), saved=saved)
    return LayerProfile(
        forward=statistics.median(fwd),
        backward=statistics.median(bwd),
        param_bytes=param_bytes,
        optimizer_bytes=param_bytes * ADAMW_STATE_PER_PARAM,
        activation_bytes=saved,
        output_bytes=conf.microbatch * cfg.seq_len * cfg.d_model * compute_dtype(conf.device).itemsize,
        tp_allreduces=tp_allreduces,
        recompute=modes,
    )


def _recompute_costs(cfg: GPTConfig, index: int, conf: ProfilerConfig, x: torch.Tensor, *, forward: float,
                     saved: int) -> dict[str, RecomputeCost]:
    """A block under `selective` and `full`: what it keeps (counted as for `none`), and what its
    backward runs again: the attention core, timed alone (median of the repeats), or the block's
    measured `forward` with its two forward all-reduces; under `full` its `saved` activations
    live again meanwhile."""
    if cfg.layer_kind(index) != "block":
        return {}
    out = {}
    for mode in ("selective", "full"):
        stage = GPTStage(cfg, first=index, last=index + 1, device=conf.device, recompute=mode)
        params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
        with _autocast(conf.device):
            _, kept = forward_counting_saved(lambda: stage(x, dropout_key=index), params)  # noqa: B023
        extra = forward if mode == "full" else _core_seconds(stage, x, index, conf)
        out[mode] = RecomputeCost(activation_bytes=kept, extra=extra, allreduces=rerun_allreduces(mode),
                                  workspace_bytes=saved if mode == "full" else 0)
    return out


def _core_seconds(stage: GPTStage, x: torch.Tensor, key: int, conf: ProfilerConfig) -> float:
    """Median seconds of the attention core's forward of `stage`'s one block on `x`'s microbatch."""
    (block,) = (typing.cast(Block, b) for b in stage.blocks.values())
    with torch.no_grad(), _autocast(conf.device):
        qkv = block.attn.qkv(block.ln1(x))
        times = [_timed(conf.device, lambda: block.attn.core(qkv, key))[0] for _ in range(conf.warmup + conf.repeats)]
    return statistics.median(times[conf.warmup:])


def forward_counting_saved(
    forward: Callable[[], torch.Tensor], params: set[int]
) -> tuple[torch.Tensor, int]:
    """Run `forward`, counting the bytes of the distinct non-parameter storages autograd saves.
    What the hook keeps is a detached view: a saved output kept as itself would hold its own
    node, a cycle through autograd's C++ graph that Python's collector cannot free (it kept a
    forward that no backward followed alive, and the tensor-parallel groups its layers use)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return out, sum(storages.values())


def _timed(device: torch.device, fn: Callable[[], _T]) -> tuple[float, _T]:
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return time.perf_counter() - start, result


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
