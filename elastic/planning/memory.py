"""The memory one worker needs, in bytes, by the model the planner plans with (`footprint.py`):
the estimate to hold a measured peak against, and the memory budget of a device.

`worker_memory` is the planner's count for one worker holding layers [first, last) of a plan:
parameters and everything kept with them step to step (equal, byte for byte, to the tensors the
engine allocates: tests/engine/test_memory_model.py), the activations the 1F1B schedule keeps
alive at its peak (what the layers save for backward, and a non-last stage's output), the head's
loss temporaries, and the device's reserve (CUDA context and communicators). Transient buffers
below those (one layer's backward, a parameter's gradient on its way into the sums, a received
gradient) are not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil

from elastic.model.config import GPTConfig
from elastic.planning.activation_memory import (
    compute_bytes,
    head_bytes,
    layer_saved,
    recompute_workspace,
    saved_bytes,
)
from elastic.planning.cluster import DEFAULT_MEMORY_GIB
from elastic.planning.footprint import (
    AUTOCAST_DEVICE_TYPES,
    GradShare,
    StateBytes,
    layer_elements,
    reserve_bytes,
    sharded_moment_elements,
    state_bytes,
)
from templates.interleave import in_flight as interleaved_in_flight
from templates.plan import Plan

if TYPE_CHECKING:  # torch loads where a dtype or a device is asked for, not here: `elastic plan` runs without it
    import torch


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """One worker's memory at its peak, by kind, in bytes."""

    params_and_state: int
    """Parameters, optimizer state, gradient buffers, exchange buffers (and their work buffers)."""
    activations: int
    """The activations the 1F1B schedule keeps alive at its peak (in-flight microbatches)."""
    head: int
    """The head's fp32 logits / softmax / loss temporaries (0 for a stage without the head)."""
    reserve: int
    """CUDA context + communicators (0 on CPU)."""
    state: StateBytes | None = None
    """`params_and_state` by kind."""

    @property
    def total(self) -> int:
        return self.params_and_state + self.activations + self.head + self.reserve


def worker_memory(
    cfg: GPTConfig,
    *,
    layers: tuple[int, int],
    microbatch_size: int,
    in_flight: int,
    tp: int = 1,
    holders: int = 1,
    compute_dtype: torch.dtype | None = None,
    partial_replay: bool = False,
    device_type: str = "cpu",
    microbatches: int | Sequence[int] = 1,
    pipeline: int = 0,
    tp_rank: int = 0,
    recompute: str = "none",
    sequence_parallel: bool = False,
    chunks: Sequence[tuple[int, int]] = (),
    chunks_in_flight: Sequence[int] = (),
    moment_elements: int | None = None,
) -> MemoryEstimate:
    """The memory of one worker holding planning layers [first, last) of `cfg` (or, interleaved,
    the layer ranges `chunks`, with `chunks_in_flight[c]` microbatches of chunk c in flight).

    `in_flight`: microbatches whose activations the schedule holds at once (1F1B: the stage's
    distance from its pipeline's end, at most the microbatches it runs). `holders`: pipelines
    holding these layers (every pipeline of a plan holds every layer). `microbatches`: what each
    holder's pipeline computes per step, in plan order (one count for all, or one per holder);
    with `pipeline`, my index among them, they fix the blocks of the step's summation tree each
    holder sums (a step without replay). `partial_replay`: the engine keeps a copy of its sums
    when a step is abandoned (only with more than one pipeline). `compute_dtype`: the forward's
    dtype (bf16 under the engine's autocast on CUDA, fp32 elsewhere; None: `device_type`'s, as
    the planner's profile counts it). `tp_rank`: rank 0 (any rank
    with the optimizer sharded) also measures its slices of the gradient norm in the exchange. `recompute`: what the stage's
    backward recomputes (model/gpt.py): its saved activations, and under `full` one block's
    activations living again during its backward (`recompute_workspace`). `sequence_parallel`:
    the stages split the sequence between the tensor-parallel regions (and send their shard).
    `moment_elements`: the optimizer is sharded, and keeps moments of this many elements
    (`footprint.sharded_moment_elements`).
    """
    ranges = tuple(chunks) or (layers,)
    for first, last in ranges:
        if not 0 <= first < last <= cfg.num_layers:
            raise ValueError(f"layers [{first}, {last}) are not a non-empty range of [0, {cfg.num_layers})")
    counts = tuple(chunks_in_flight) or (in_flight,) * len(ranges)
    if len(counts) != len(ranges):
        raise ValueError(f"{len(counts)} in-flight counts for {len(ranges)} chunks")
    if microbatch_size < 1 or in_flight < 1 or holders < 1:
        raise ValueError(f"microbatch_size {microbatch_size}, in_flight {in_flight}, holders {holders}: each must be >= 1")
    split = [microbatches] * holders if isinstance(microbatches, int) else list(microbatches)
    if len(split) != holders:
        raise ValueError(f"{len(split)} microbatch counts for {holders} holders")
    share = GradShare.of_split(split, me=pipeline, partial_replay=partial_replay, tp_rank=tp_rank,
                               sharded=moment_elements is not None)
    held = sorted(i for first, last in ranges for i in range(first, last))
    state = state_bytes([], share, device_type, chunks=[[layer_elements(cfg, i, tp) for i in range(first, last)]
                                                          for first, last in ranges],
                        moment_elements=moment_elements)
    tokens = microbatch_size * cfg.seq_len
    element = compute_bytes(device_type) if compute_dtype is None else compute_dtype.itemsize
    activations = max(recompute_workspace(cfg, rng, tp=tp, recompute=recompute, tokens=tokens, element_bytes=element,
                                          sequence_parallel=sequence_parallel) for rng in ranges)
    for (first, last), count in zip(ranges, counts, strict=True):
        per_microbatch = sum(saved_bytes(layer_saved(cfg, i, tp, recompute, sequence_parallel), tokens=tokens,
                                         element_bytes=element) for i in range(first, last))
        if last < cfg.num_layers:  # a non-last (virtual) stage keeps its output (the wire's dtype) until its backward
            per_microbatch += tokens * cfg.d_model * element // (tp if sequence_parallel else 1)
        activations += count * per_microbatch
    head = head_bytes(cfg, tokens=tokens, tp=tp, element_bytes=element) if held[-1] == cfg.num_layers - 1 else 0
    return MemoryEstimate(params_and_state=state.total, activations=activations, head=head,
                          reserve=reserve_bytes(device_type), state=state)


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype the engine's forward computes in on `device` (`engine/device.py`
    compute_precision: bf16 autocast on CUDA, fp32 elsewhere)."""
    import torch

    return torch.bfloat16 if device.type in AUTOCAST_DEVICE_TYPES else torch.float32


@dataclass(frozen=True, kw_only=True)
class PlanMemory:
    """The largest worker of a plan by `worker_memory`, and where it is."""

    estimate: MemoryEstimate
    pipeline: int
    stage: int
    node: int


def plan_memory(cfg: GPTConfig, plan: Plan, *, device_type: str = "cpu", sequence_parallel: bool = True,
                sharded_optimizer: bool = False, partial_replay: bool = True) -> PlanMemory:
    """Every worker of `plan` by `worker_memory` (its stage's layers or chunks, its schedule's
    microbatches in flight at the peak: 1F1B's p - s, the interleaved table's per chunk; the
    compute dtype of `device_type`; sequence parallelism at TP > 1 unless told otherwise; the
    sharded optimizer's slices), and the largest. Runs without torch (`elastic plan`)."""
    tp, counts = plan.gpus_per_node, [p.microbatches for p in plan.pipelines]
    best: PlanMemory | None = None
    for index, pipe in enumerate(plan.pipelines):
        depth = len(pipe.stages)
        for s, stage in enumerate(pipe.stages):
            chunks = stage.ranges if pipe.virtual_stages > 1 else ()
            flights = interleaved_in_flight(depth, s, pipe.virtual_stages) if chunks else ()
            held = [i for first, last in stage.ranges for i in range(first, last)]
            moments = (sharded_moment_elements(cfg, plan, node=stage.node, layers=held, tp=tp)
                       if sharded_optimizer else None)
            estimate = worker_memory(
                cfg, layers=stage.layers, chunks=chunks, chunks_in_flight=flights,
                microbatch_size=plan.microbatch_size, in_flight=min(depth - s, pipe.microbatches), tp=tp,
                holders=len(plan.pipelines), partial_replay=partial_replay,
                device_type=device_type, microbatches=counts, pipeline=index, recompute=stage.recompute,
                sequence_parallel=sequence_parallel and tp > 1, moment_elements=moments)
            if best is None or estimate.total > best.estimate.total:
                best = PlanMemory(estimate=estimate, pipeline=index, stage=s, node=stage.node)
    assert best is not None
    return best


def device_memory_bytes(device: torch.device) -> int:
    """Memory of `device`: an accelerator's total memory (of which `reserve_bytes` hold the
    context and communicators), the host's RAM for the CPU."""
    import torch

    if device.type == "cpu":
        return int(psutil.virtual_memory().total)
    return int(torch.get_device_module(device.type).get_device_properties(device).total_memory)


def default_memory_gib(device_type: str) -> float:
    """The memory of a device to plan for when none is given: this machine's first `device_type`
    accelerator's (its reserve comes off it in the profile), else the nominal DEFAULT_MEMORY_GIB
    (always on the CPU, whose host memory is no device budget)."""
    if device_type != "cpu":
        import torch

        module = torch.get_device_module(device_type)
        if module.is_available():
            return device_memory_bytes(torch.device(device_type, 0)) / 2**30
    return DEFAULT_MEMORY_GIB
