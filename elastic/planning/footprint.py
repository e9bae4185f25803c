"""One worker's memory, counted the way the engine allocates it: the one memory model that the
planner's memory check (through the profile, `cluster.py`) and `memory.worker_memory` share.

Torch-free arithmetic: the records and the leader import the planner, and they must not load
torch. The engine's constants are mirrored here, each naming its source; the rule that these
counts equal the bytes of the tensors the engine creates is `tests/engine/test_memory_model.py`.

What a worker holding parameters keeps from step to step (`state_bytes`):

- the fp32 master weights (4 B per parameter: `engine/adamw.py` refuses any other dtype) and
  AdamW's two fp32 moments (8 B);
- per gradient bucket (`parallel/buckets.py`: a layout bucket's layers cut into runs of whole
  layers, the first closed at 1 MiB of fp32 gradient, later ones at 25 MiB), flat fp32 buffers
  padded to a multiple of the bucket's holder count P (`parallel/grad_accum.py`): the reduced
  gradient, one sum per block of the step's summation tree the worker computes (B blocks), and,
  with partial replay on and more than one pipeline, a snapshot copy of those sums
  (`engine/step.py` `_keep_partial`, made when a step is abandoned and kept after);
- per parameter (unpadded), one fp32 scratch per tree level a block of 4 or more microbatches
  climbs (L = log2(largest block) - 1 levels; `GradAccumulator._climb`);
- the tree exchange's receive buffers (`BucketReducer._scratch`): one slice (1/P of the padded
  bucket) per block of every other holder (R blocks in all);
- work buffers: per bucket the combine's scratch (as many as its program needs: on the CPU
  SUM_CHUNK elements each, on an accelerator one slice each), on tensor-parallel rank 0 (any
  rank, with the optimizer sharded) the exchange's 0-dim float64 norm (and on the CPU its float64 chunk), per worker on the CPU the
  float64 chunk of the gradient norm, AdamW's step count and, with partial replay, the step's
  loss share.

So, per parameter (the padding and the fixed work buffers come on top, `state_bytes`):

    state_bytes_per_param = 4 + 8 + 4 x (1 + B + S + L) + 4 x R / P      (S = B with a snapshot, else 0)

One pipeline of 2^k microbatches (one block): 4 + 8 + 4 x (2 + max(0, k - 1)) = 20 B for up
to 2 microbatches, 24 B for 4, 28 B for 8. Two pipelines with one block each and partial replay
add 4 x 1/2 of receive buffers and 4 of snapshot.

The summation tree's blocks and combine scratch are `sum_tree.py`; what activations take per
token (compute dtype, autocast copies, the head's loss) is `activation_memory.py`; the figures
the planner's memory check adds per parameter and per worker are `planner_figures.py`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from elastic.model.config import GPTConfig
from elastic.planning.sum_tree import Block, combine_scratch, tree_blocks, tree_levels
from templates.optim_slices import plan_owners
from templates.plan import Plan

WEIGHT_BYTES = 4
"""Bytes of one master weight (fp32, `engine/adamw.py`)."""
MOMENT_BYTES = 8
"""Bytes of AdamW's exp_avg and exp_avg_sq of one parameter (fp32 each)."""
GRAD_BYTES = 4
"""Bytes of one element of the gradient sums, the reduced gradient, the receive buffers, the
snapshot and the tree scratch (float32, `parallel/grad_accum.py`)."""
FIRST_BUCKET_BYTES = 2**20
"""`parallel/buckets.py` FIRST_BUCKET_BYTES: a layout bucket's first run closes at this many
fp32 gradient bytes."""
BUCKET_BYTES = 25 * 2**20
"""`parallel/buckets.py` BUCKET_BYTES: every later run closes at this many."""
SUM_CHUNK = 1 << 16
"""`parallel/exchange.py` SUM_CHUNK: elements of one combine scratch buffer."""
NORM_CHUNK = 1 << 18
"""`parallel/grad_sync.py` _NORM_CHUNK: float64 elements of a worker's norm scratch."""
NORM_BYTES = 8
"""Bytes of one float64 element of the norm's buffers."""
STEP_COUNT_BYTES = 4
"""`engine/adamw.py`: the 0-dim float32 step count the fused kernel reads, one per device."""
LOSS_BYTES = 8
"""`engine/step.py`: with partial replay on, the step's loss share stays on the device (0-dim
float64) until it is read, should the step be abandoned."""
CHUNKED_DEVICE_TYPES = ("cpu",)
"""Device types whose combine and norm work SUM_CHUNK / NORM_CHUNK elements at a time through
buffers of that size (`bucket_reducer._chunk`); elsewhere a slice at a time, with no float64 buffer."""

AUTOCAST_DEVICE_TYPES = ("cuda",)
"""Device types whose forward runs under bf16 autocast (`engine/device.py` compute_precision)."""
LOW_PRECISION_BYTES = 2
"""Bytes of one element in the autocast dtype (bf16)."""
RESERVE_BYTES = {"cuda": 2**30}
"""Per device type, bytes the training tensors cannot use: on CUDA the context (about 0.5 GiB
with lazily loaded modules, more with cuBLAS and cuDNN workspaces) and the communicators' own
buffers (NCCL: a few MiB per peer and channel); none on the CPU."""
DEVICE_TYPES = ("cpu", *AUTOCAST_DEVICE_TYPES)
"""Device types the memory model knows."""


def reserve_bytes(device_type: str) -> int:
    """Bytes of a `device_type` device that hold no training tensor (context, communicators)."""
    return RESERVE_BYTES.get(device_type, 0)


class ShareLike(Protocol):
    """What the memory formulas read of a worker's part in the tree (GradShare, ShareCounts)."""

    @property
    def pipelines(self) -> int: ...
    @property
    def levels(self) -> int: ...
    @property
    def peer_blocks(self) -> int: ...
    @property
    def copies(self) -> int: ...
    @property
    def snapshot(self) -> bool: ...
    @property
    def measures(self) -> bool: ...
    def combine_scratch(self) -> int: ...


@dataclass(frozen=True, kw_only=True)
class ShareCounts:
    """A GradShare reduced to the counts the formulas read (`planner_figures` builds these from
    a whole split at once, `split_blocks.py`, not from P holders' block tuples)."""

    pipelines: int
    own_blocks: int
    levels: int
    peer_blocks: int
    scratch: int
    """`combine_scratch()`: of every holder's blocks (of mine alone with one pipeline)."""
    snapshot: bool
    measures: bool = True

    @property
    def copies(self) -> int:
        return 1 + self.own_blocks * (2 if self.snapshot else 1)

    def combine_scratch(self) -> int:
        return self.scratch


@dataclass(frozen=True, kw_only=True)
class GradShare:
    """A worker's part in its step's summation tree: what its gradient buffers depend on."""

    holders: tuple[tuple[Block, ...], ...]
    """Per holder of the worker's layers (one per pipeline, in plan order), the blocks it sends."""
    me: int = 0
    """The worker's index in `holders`."""
    snapshot: bool = False
    """Whether a copy of the sums is kept for partial replay (on, with more than one pipeline)."""
    measures: bool = True
    """Whether it measures its slices of the gradient norm in the exchange (tensor-parallel rank 0,
    and every rank with the optimizer sharded: `engine/shard_reduce.py`)."""

    @classmethod
    def of_split(
        cls, microbatches: Sequence[int], *, me: int = 0, partial_replay: bool = False, tp_rank: int = 0,
        sharded: bool = False,
    ) -> GradShare:
        """The share of pipeline `me` when the pipelines compute `microbatches[p]` consecutive
        microbatches each, in plan order (a step without replay); `sharded`: the optimizer is."""
        if not microbatches or min(microbatches) < 1 or not 0 <= me < len(microbatches):
            raise ValueError(f"pipeline {me} of microbatch split {list(microbatches)}")
        starts = list(itertools.accumulate(microbatches, initial=0))[:-1]
        holders = tuple(tree_blocks(s, m) for s, m in zip(starts, microbatches, strict=True))
        return cls(holders=holders, me=me, snapshot=partial_replay and len(microbatches) > 1,
                   measures=tp_rank == 0 or sharded)

    @property
    def pipelines(self) -> int:
        """P: holders of each of the worker's layers."""
        return len(self.holders)

    @property
    def blocks(self) -> tuple[Block, ...]:
        return self.holders[self.me]

    @property
    def levels(self) -> int:
        return tree_levels(self.blocks)

    @property
    def peer_blocks(self) -> int:
        """R: blocks the other holders send (one receive buffer of one slice each)."""
        return sum(len(b) for j, b in enumerate(self.holders) if j != self.me)

    @property
    def copies(self) -> int:
        """Padded fp32 buffers per bucket: the reduced gradient, the sums and their snapshot."""
        return 1 + len(self.blocks) * (2 if self.snapshot else 1)

    def combine_scratch(self) -> int:
        """Chunk buffers the bucket's combine needs (every holder's blocks, or only mine alone)."""
        blocks = [b for theirs in self.holders for b in theirs] if self.pipelines > 1 else list(self.blocks)
        return combine_scratch(blocks)


def state_bytes_per_param(share: GradShare) -> float:
    """THE per-parameter figure: weights, AdamW moments, gradient buffers and exchange buffers
    (padding and fixed work buffers aside, see the module docstring)."""
    return WEIGHT_BYTES + MOMENT_BYTES + grad_bytes_per_param(share)


def grad_bytes_per_param(share: ShareLike) -> float:
    """The gradient side of `state_bytes_per_param`: sums, reduced gradient, snapshot, tree
    scratch and receive buffers."""
    return GRAD_BYTES * (share.copies + share.levels) + GRAD_BYTES * share.peer_blocks / share.pipelines


# ---- the exact count ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StateBytes:
    """Bytes a worker keeps for its parameters, by kind."""

    weights: int
    """fp32 master weights."""
    moments: int
    """AdamW exp_avg and exp_avg_sq."""
    gradients: int
    """Reduced gradient, block sums and their snapshot (padded), tree-level scratch."""
    exchange: int
    """Receive buffers of the tree exchange."""
    work: int
    """Chunk scratch of the combines, the norm's float64 buffers, the step count."""

    @property
    def total(self) -> int:
        return self.weights + self.moments + self.gradients + self.exchange + self.work


def bucket_runs(layer_elements: Sequence[int]) -> list[int]:
    """Elements of each gradient bucket of a layout bucket whose layers hold `layer_elements`
    parameters (ascending layers): runs of whole layers from the last one down, the first closed
    at FIRST_BUCKET_BYTES of fp32 gradient, later ones at BUCKET_BYTES (`split_layers`)."""
    runs: list[int] = []
    run = held = 0
    for elements in reversed(layer_elements):
        run += elements
        held += GRAD_BYTES * elements
        if held >= (BUCKET_BYTES if runs else FIRST_BUCKET_BYTES):
            runs.append(run)
            run = held = 0
    if run:
        runs.append(run)
    return runs


def bucket_work_bytes(elements: int, share: ShareLike, device_type: str = "cpu") -> int:
    """Work buffers of one bucket of `elements` parameters (`BucketReducer._scratch`)."""
    p = share.pipelines
    padded = -(-elements // p) * p
    chunked = device_type in CHUNKED_DEVICE_TYPES
    if p == 1:  # no exchange: my blocks combined on the training thread
        return GRAD_BYTES * (min(padded, SUM_CHUNK) if chunked else padded) * share.combine_scratch()
    chunk = min(padded // p, SUM_CHUNK) if chunked else padded // p
    measure = NORM_BYTES * (1 + (chunk if chunked else 0)) if share.measures else 0
    return GRAD_BYTES * chunk * share.combine_scratch() + measure


def worker_work_bytes(device_type: str = "cpu") -> int:
    """Work buffers of a worker whatever its buckets: the norm's float64 chunk (on the CPU) and
    AdamW's step count."""
    return (NORM_BYTES * NORM_CHUNK if device_type in CHUNKED_DEVICE_TYPES else 0) + STEP_COUNT_BYTES


def state_bytes(layer_elements: Sequence[int], share: GradShare, device_type: str = "cpu",
                *, chunks: Sequence[Sequence[int]] = (), moment_elements: int | None = None) -> StateBytes:
    """What a worker on a `device_type` device keeps for layers holding `layer_elements`
    parameters each (its shards, ascending layers, all with the same holders: one layout bucket)
    in the tree `share`; interleaved, `chunks` instead: each chunk's layers, a layout bucket of
    its own (buckets never span two chunks: elastic/parallel/plan_ranks.py). `moment_elements`:
    with the optimizer sharded, the elements of its slices (`sharded_moment_elements`)."""
    p = share.pipelines
    weights = moments = gradients = exchange = 0
    work = worker_work_bytes(device_type) + (LOSS_BYTES if share.snapshot else 0)
    runs = [n for group in (chunks or [layer_elements]) for n in bucket_runs(group)]
    for n in runs:
        padded = -(-n // p) * p
        weights += WEIGHT_BYTES * n
        moments += MOMENT_BYTES * n
        gradients += GRAD_BYTES * (padded * share.copies + n * share.levels)
        exchange += GRAD_BYTES * padded // p * share.peer_blocks
        work += bucket_work_bytes(n, share, device_type)
    if moment_elements is not None:
        moments = MOMENT_BYTES * moment_elements
    return StateBytes(weights=weights, moments=moments, gradients=gradients, exchange=exchange, work=work)


def layer_param_sizes(cfg: GPTConfig, index: int, tp: int = 1) -> list[int]:
    """The elements of each parameter of planning layer `index` on one of `tp` ranks, in name
    order (the order the sharded optimizer cuts a layer in, `templates.optim_slices`); they add
    up to `layer_elements`."""
    cfg.check_tensor_parallel(tp)
    d, f, v, kind = cfg.d_model, cfg.d_ff, cfg.vocab_size // tp, cfg.layer_kind(index)
    if cfg.arch == "llama":  # model/llama.py: no biases (but Qwen2's qkv), no positions, RMSNorm weights only
        if kind == "embedding":
            return [v * d]  # embed.wte.weight
        if kind == "head":
            return [v * d, d]  # head.lm_head.weight, head.ln_f.weight
        # attn.proj, attn.qkv (bias, weight), ln1, ln2, mlp.fc (gate and up), mlp.proj
        qkv = [cfg.qkv_rows(tp), cfg.qkv_rows(tp) * d] if cfg.qkv_bias else [cfg.qkv_rows(tp) * d]
        return [d * d // tp, *qkv, d, d, 2 * f // tp * d, d * f // tp]  # qkv: shared KV heads whole
    if kind == "embedding":
        return [cfg.seq_len * d, v * d]  # embed.wpe, embed.wte.weight
    if kind == "head":
        return [v * d, d, d]  # head.lm_head.weight, head.ln_f.bias, head.ln_f.weight
    # attn.proj (bias replicated), attn.qkv, ln1, ln2, mlp.fc, mlp.proj (bias replicated): biases first
    return [d, d * d // tp, 3 * d // tp, 3 * d * d // tp, d, d, d, d, f // tp, f * d // tp, d, d * f // tp]


def sharded_moment_elements(cfg: GPTConfig, plan: Plan, *, node: int, layers: Sequence[int], tp: int = 1) -> int:
    """The optimizer elements a sharded worker on `node` keeps for `layers` under `plan`: its
    slice of each (`templates.optim_slices.plan_owners`, cut by `aligned_cuts`)."""
    owners = plan_owners(plan)
    total = 0
    for layer in layers:
        j = owners[layer].slice_of(node)
        if j is None:
            raise ValueError(f"node {node} does not hold layer {layer}")
        lo, hi = owners[layer].bounds(j, layer_param_sizes(cfg, layer, tp))
        total += hi - lo
    return total


def layer_elements(cfg: GPTConfig, index: int, tp: int = 1) -> int:
    """Parameters of planning layer `index` on one of `tp` tensor-parallel ranks (`model/gpt.py`:
    LayerNorms, positions and row-parallel biases are replicated, the rest is split)."""
    cfg.check_tensor_parallel(tp)
    d, kind = cfg.d_model, cfg.layer_kind(index)
    if cfg.arch == "llama":
        return sum(layer_param_sizes(cfg, index, tp))
    if kind == "embedding":
        return cfg.vocab_size // tp * d + cfg.seq_len * d
    if kind == "head":
        return 2 * d + cfg.vocab_size // tp * d
    replicated = 4 * d + 2 * d  # ln1, ln2; the biases of attn.proj and mlp.proj
    split = 3 * d * d + 3 * d + d * d + cfg.d_ff * d + cfg.d_ff + d * cfg.d_ff  # qkv, attn.proj, fc, mlp.proj
    return replicated + split // tp
