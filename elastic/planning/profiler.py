"""The measuring half of `elastic profile`: time every planning layer of a GPT on this device.

Each layer is built alone as a `GPTStage(cfg, first=i, last=i+1)` and, per microbatch, timed
for forward and, separately, for backward (the gradient of a random upstream gradient, so the
backward is measured, never assumed to be a multiple of forward); the median of the repeats
is kept. Activation bytes are the tensors autograd saves for backward (counted through the
public saved-tensor hooks, each storage once). Parameter bytes are the module's; optimizer
bytes assume AdamW's two fp32 moments per parameter. Link costs are not measured here: they
keep `templates.derive.DeviceSpeed`'s defaults, which the profile notes say.

Models too large to run here get a profile derived from FLOP/byte counts, scaled by the
measured matmul speed of this device.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import psutil
import torch

from elastic.model.config import GPTConfig
from elastic.model.gpt import GPTStage
from templates.derive import ADAMW_STATE_PER_PARAM, DeviceSpeed, LayerCounts, derive_profile
from templates.profile import LayerProfile, Profile

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
    """Memory budget of one device to write into the profile."""
    warmup: int = 1
    """Untimed runs per layer before timing."""
    repeats: int = 3
    """Timed runs per layer; the median is kept."""


def default_memory_bytes(device: torch.device) -> int:
    """Total memory of `device` (host RAM for the CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(psutil.virtual_memory().total)


def matmul_flops_per_second(device: torch.device, size: int = 512, repeats: int = 5) -> float:
    """Achieved fp32 FLOP/s of a square matmul on `device` (best of `repeats`)."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def should_measure(cfg: GPTConfig, counts: list[LayerCounts], conf: ProfilerConfig, flops: float) -> bool:
    """Whether the model is small enough to run layer by layer on this device."""
    state = sum(c.params for c in counts) * 4 * (2 + ADAMW_STATE_PER_PARAM)
    seconds = 3 * sum(c.flops_per_token for c in counts) * cfg.seq_len * conf.microbatch / flops
    return state <= _MEASURE_MEMORY_SHARE * conf.memory_bytes and seconds <= _MEASURE_MAX_SECONDS


def measure_profile(name: str, cfg: GPTConfig, counts: list[LayerCounts], conf: ProfilerConfig) -> Profile:
    """Time every planning layer of `cfg` on `conf.device`."""
    if len(counts) != cfg.num_layers:
        raise ValueError(f"{len(counts)} layer descriptions for {cfg.num_layers} planning layers")
    torch.manual_seed(0)
    layers = [_measure_layer(cfg, i, counts[i].tp_allreduces, conf) for i in range(cfg.num_layers)]
    speed = DeviceSpeed(flops_per_second=1.0, memory_bytes=conf.memory_bytes)
    notes = (
        f"measured on {conf.device} ({torch.get_num_threads()} threads), fp32, median of {conf.repeats}; "
        f"backward timed separately; optimizer = AdamW fp32 moments (8 B/param); activations = tensors "
        f"saved for backward; link costs are defaults, not measured"
    )
    return Profile(
        model=name,
        microbatch_size=conf.microbatch,
        layers=tuple(layers),
        device=speed.device_profile(),
        source="measured",
        notes=notes,
    )


def derived_from_speed(
    name: str, cfg: GPTConfig, counts: list[LayerCounts], conf: ProfilerConfig, flops: float
) -> Profile:
    """FLOP/byte counts scaled by the measured matmul speed `flops` of this device."""
    device = DeviceSpeed(
        flops_per_second=flops,
        memory_bytes=conf.memory_bytes,
        description=f"measured fp32 matmul speed of {conf.device}; model too large to run here",
    )
    return derive_profile(
        model=name, layers=counts, seq_len=cfg.seq_len, microbatch_size=conf.microbatch, device=device
    )


def _measure_layer(cfg: GPTConfig, index: int, tp_allreduces: int, conf: ProfilerConfig) -> LayerProfile:
    stage = GPTStage(cfg, first=index, last=index + 1, device=conf.device)
    shape = (conf.microbatch, cfg.seq_len)
    if index == 0:
        x = torch.randint(0, cfg.vocab_size, shape, device=conf.device)  # (batch, seq)
    else:
        x = torch.randn(*shape, cfg.d_model, device=conf.device, requires_grad=True)  # (batch, seq, d_model)

    def forward() -> torch.Tensor:
        return stage(x, dropout_key=index)

    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    fwd: list[float] = []
    bwd: list[float] = []
    saved = 0
    for run in range(conf.warmup + conf.repeats):
        stage.zero_grad(set_to_none=True)
        elapsed, (out, saved) = _timed(conf.device, lambda: _forward_counting_saved(forward, params))
        upstream = torch.randn_like(out)
        back, _ = _timed(conf.device, functools.partial(out.backward, upstream))
        if run >= conf.warmup:
            fwd.append(elapsed)
            bwd.append(back)
    param_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
    return LayerProfile(
        forward=statistics.median(fwd),
        backward=statistics.median(bwd),
        param_bytes=param_bytes,
        optimizer_bytes=param_bytes * ADAMW_STATE_PER_PARAM,
        activation_bytes=saved,
        output_bytes=conf.microbatch * cfg.seq_len * cfg.d_model * 4,
        tp_allreduces=tp_allreduces,
    )


def _forward_counting_saved(
    forward: Callable[[], torch.Tensor], params: set[int]
) -> tuple[torch.Tensor, int]:
    """Run `forward`, counting the bytes of the distinct non-parameter storages autograd saves."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

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
