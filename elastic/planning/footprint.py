"""One worker's memory, counted the way the engine allocates it: the one memory model that the
planner's memory check (through the profile, `cluster.py`) and `memory.worker_memory` share.

Torch-free arithmetic: the records and the leader import the planner, and they must not load
torch. The engine's constants are mirrored here, each naming its source; the rule that these
counts equal the bytes of the tensors the engine creates is `tests/engine/test_memory_model.py`.

What a worker holding parameters keeps from step to step (`state_bytes`):

- the fp32 master weights (4 B per parameter: `engine/adamw.py` refuses any other dtype) and
  AdamW's two fp32 moments (8 B);
- per gradient bucket (`parallel/grad_sync.py`: a layout bucket's layers cut into runs of whole
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
  SUM_CHUNK elements each, on an accelerator one slice each), on tensor-parallel rank 0 the
  exchange's 0-dim float64 norm (and on the CPU its float64 chunk), per worker on the CPU the
  float64 chunk of the gradient norm, AdamW's step count and, with partial replay, the step's
  loss share.

So, per parameter (the padding and the fixed work buffers come on top, `state_bytes`):

    state_bytes_per_param = 4 + 8 + 4 x (1 + B + S + L) + 4 x R / P      (S = B with a snapshot, else 0)

One pipeline of 2^k microbatches (one block): 4 + 8 + 4 x (2 + max(0, k - 1)) = 20 B for up
to 2 microbatches, 24 B for 4, 28 B for 8. Two pipelines with one block each and partial replay
add 4 x 1/2 of receive buffers and 4 of snapshot.

Activations are counted per token in the compute dtype (fp32 on CPU, bf16 under the engine's
autocast on CUDA), beside what stays fp32 whatever the compute dtype (the residual stream and
LayerNorm statistics), and under autocast the bf16 copies of the matmul weights that each
microbatch's forward makes and keeps for its backward. The head's loss (`model/tp_layers.py`)
works in fp32 over the logits: at its peak the logits, their fp32 copy, the shifted logits, their
exponentials and the softmax it keeps for backward live together.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from elastic.model.config import GPTConfig
from elastic.planning.split_blocks import even_split_blocks

WEIGHT_BYTES = 4
"""Bytes of one master weight (fp32, `engine/adamw.py`)."""
MOMENT_BYTES = 8
"""Bytes of AdamW's exp_avg and exp_avg_sq of one parameter (fp32 each)."""
GRAD_BYTES = 4
"""Bytes of one element of the gradient sums, the reduced gradient, the receive buffers, the
snapshot and the tree scratch (float32, `parallel/grad_accum.py`)."""
FIRST_BUCKET_BYTES = 2**20
"""`parallel/grad_sync.py` FIRST_BUCKET_BYTES: a layout bucket's first run closes at this many
fp32 gradient bytes."""
BUCKET_BYTES = 25 * 2**20
"""`parallel/grad_sync.py` BUCKET_BYTES: every later run closes at this many."""
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
buffers of that size (`grad_sync._chunk`); elsewhere a slice at a time, with no float64 buffer."""

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

Block = tuple[int, int]
"""(start, size): an aligned block of the step's summation tree (`parallel/blocks.py`)."""


def compute_bytes(device_type: str) -> int:
    """Bytes of one activation element in the compute dtype on `device_type`."""
    return LOW_PRECISION_BYTES if device_type in AUTOCAST_DEVICE_TYPES else WEIGHT_BYTES


def reserve_bytes(device_type: str) -> int:
    """Bytes of a `device_type` device that hold no training tensor (context, communicators)."""
    return RESERVE_BYTES.get(device_type, 0)


# ---- the summation tree (parallel/blocks.py) ---------------------------------------------------


def tree_blocks(start: int, count: int) -> tuple[Block, ...]:
    """The blocks of microbatches [start, start + count): the fewest aligned ones (`decompose`)."""
    out: list[Block] = []
    end = start + count
    while start < end:
        size = 1
        while start % (2 * size) == 0 and start + 2 * size <= end:
            size *= 2
        out.append((start, size))
        start += size
    return tuple(out)


def tree_levels(blocks: Sequence[Block]) -> int:
    """Scratch levels the tree-order accumulation of `blocks` climbs (a block of 2^k: k - 1)."""
    return max((max(0, size.bit_length() - 2) for _, size in blocks), default=0)


def combine_scratch(blocks: Sequence[Block]) -> int:
    """Scratch buffers the tree-order combine of `blocks` needs (`CombineProgram.scratch`): one
    per addition of two inputs; an addition with a scratch operand writes into it. Remembered
    per multiset of blocks: every holder of a plan's layers combines the same blocks, and the
    planner asks once per holder (`planner_figures`)."""
    return _combine_scratch(tuple(sorted(blocks)))


@functools.lru_cache(maxsize=64)  # the planner asks for one plan's blocks in a row
def _combine_scratch(blocks: tuple[Block, ...]) -> int:
    if all(a[0] + a[1] <= b[0] for a, b in zip(blocks, blocks[1:], strict=False)):
        return disjoint_scratch(blocks)
    return tree_scratch(blocks)


def disjoint_scratch(blocks: tuple[Block, ...]) -> int:
    """`combine_scratch` of disjoint aligned blocks in order (every plan's step), in one pass. The
    combine adds two inputs only at a node whose halves each hold one block and nothing else: the
    smallest aligned range over two neighbours, when it holds no third block (the blocks a node
    holds are consecutive)."""
    made = 0
    for i in range(len(blocks) - 1):
        (s1, _), (s2, z2) = blocks[i], blocks[i + 1]
        k = (s1 ^ (s2 + z2 - 1)).bit_length()
        lo, hi = (s1 >> k) << k, ((s1 >> k) + 1) << k
        left_alone = i == 0 or blocks[i - 1][0] < lo
        right_alone = i + 2 >= len(blocks) or blocks[i + 2][0] + blocks[i + 2][1] > hi
        made += left_alone and right_alone
    return made


def tree_scratch(blocks: tuple[Block, ...]) -> int:
    """`combine_scratch` by walking the tree (any blocks, repeated or nested)."""
    count = Counter(blocks)
    unique = sorted(count)
    end = max(start + size for start, size in unique)
    top = 1
    while top < end:
        top *= 2
    made = 0

    def node(start: int, size: int, inside: list[Block]) -> bool | None:
        """Whether the subtree's sum is a scratch (True) or an input (False); None: empty."""
        nonlocal made
        inside = [b for b in inside if start <= b[0] and b[0] + b[1] <= start + size]
        if not inside:
            return None
        refs: list[bool] = [False] * count.get((start, size), 0)
        if any(b[1] < size for b in inside):
            half = size // 2
            refs += [c for c in (node(start, half, inside), node(start + half, half, inside)) if c is not None]
        acc = refs[0]
        for ref in refs[1:]:
            made += not (acc or ref)
            acc = True
        return acc

    node(0, top, unique)
    return made


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
    """Whether it measures its slices of the gradient norm in the exchange (tensor-parallel rank 0)."""

    @classmethod
    def of_split(
        cls, microbatches: Sequence[int], *, me: int = 0, partial_replay: bool = False, tp_rank: int = 0
    ) -> GradShare:
        """The share of pipeline `me` when the pipelines compute `microbatches[p]` consecutive
        microbatches each, in plan order (a step without replay)."""
        if not microbatches or min(microbatches) < 1 or not 0 <= me < len(microbatches):
            raise ValueError(f"pipeline {me} of microbatch split {list(microbatches)}")
        starts = list(itertools.accumulate(microbatches, initial=0))[:-1]
        holders = tuple(tree_blocks(s, m) for s, m in zip(starts, microbatches, strict=True))
        return cls(holders=holders, me=me, snapshot=partial_replay and len(microbatches) > 1, measures=tp_rank == 0)

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


def state_bytes(layer_elements: Sequence[int], share: GradShare, device_type: str = "cpu") -> StateBytes:
    """What a worker on a `device_type` device keeps for layers holding `layer_elements`
    parameters each (its shards, ascending layers, all with the same holders: one layout bucket)
    in the tree `share`."""
    p = share.pipelines
    weights = moments = gradients = exchange = 0
    work = worker_work_bytes(device_type) + (LOSS_BYTES if share.snapshot else 0)
    for n in bucket_runs(layer_elements):
        padded = -(-n // p) * p
        weights += WEIGHT_BYTES * n
        moments += MOMENT_BYTES * n
        gradients += GRAD_BYTES * (padded * share.copies + n * share.levels)
        exchange += GRAD_BYTES * padded // p * share.peer_blocks
        work += bucket_work_bytes(n, share, device_type)
    return StateBytes(weights=weights, moments=moments, gradients=gradients, exchange=exchange, work=work)


def layer_elements(cfg: GPTConfig, index: int, tp: int = 1) -> int:
    """Parameters of planning layer `index` on one of `tp` tensor-parallel ranks (`model/gpt.py`:
    LayerNorms, positions and row-parallel biases are replicated, the rest is split)."""
    cfg.check_tensor_parallel(tp)
    d, kind = cfg.d_model, cfg.layer_kind(index)
    if kind == "embedding":
        return cfg.vocab_size // tp * d + cfg.seq_len * d
    if kind == "head":
        return 2 * d + cfg.vocab_size // tp * d
    replicated = 4 * d + 2 * d  # ln1, ln2; the biases of attn.proj and mlp.proj
    split = 3 * d * d + 3 * d + d * d + cfg.d_ff * d + cfg.d_ff + d * cfg.d_ff  # qkv, attn.proj, fc, mlp.proj
    return replicated + split // tp


# ---- activations ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Saved:
    """What one planning layer keeps from its forward to its backward, for one microbatch."""

    elements_per_token: float
    """Elements in the compute dtype."""
    bytes_per_token: float
    """Bytes whatever the compute dtype: fp32 residual stream and statistics, token ids, masks."""
    cast_params: int
    """Weight elements autocast copies to the compute dtype and keeps (none in fp32)."""
    workspace_per_token: float = 0.0
    """Elements per token the loss holds at its peak beyond them (the head), for `head_bytes`."""


def layer_saved(cfg: GPTConfig, index: int, tp: int = 1) -> Saved:
    """What planning layer `index` keeps per microbatch on one of `tp` ranks (measured on this
    model: saved-tensor hooks over one layer, fp32 and bf16 autocast).

    A block keeps in the compute dtype its two LayerNorm outputs (the column-parallel inputs) and
    its sharded q/k/v, attention output, MLP input and GELU output: 2d + 12d / tp elements; in
    fp32 its input and the residual after attention (2d), the LayerNorms' mean and rstd (4) and,
    when attention runs fused (no dropout), its log-sum-exp (n_head / tp). With dropout the
    attention probabilities are kept instead: 2 x n_head x seq / tp elements (an estimate). The
    head keeps its fp32 input and statistics and the LayerNorm output; the embedding its token
    ids (int64) and the mask of ids outside this rank's vocabulary shard.
    """
    d, kind = cfg.d_model, cfg.layer_kind(index)
    if kind == "embedding":
        return Saved(elements_per_token=0.0, bytes_per_token=8 + 1, cast_params=0)
    if kind == "head":
        return Saved(elements_per_token=float(d), bytes_per_token=4.0 * (d + 2), cast_params=cfg.vocab_size // tp * d,
                     workspace_per_token=cfg.vocab_size / tp)
    heads = cfg.n_head / tp
    attention = 2.0 * heads * cfg.seq_len if cfg.dropout > 0 else 0.0
    fused = 0.0 if cfg.dropout > 0 else 4.0 * heads
    return Saved(elements_per_token=2.0 * d + 12.0 * d / tp + attention, bytes_per_token=4.0 * (2 * d + 4) + fused,
                 cast_params=12 * d * d // tp)


def saved_bytes(saved: Saved, *, tokens: int, element_bytes: int) -> int:
    """Bytes `saved` amounts to for one microbatch of `tokens` tokens in `element_bytes` elements."""
    cast = saved.cast_params * element_bytes if element_bytes < WEIGHT_BYTES else 0
    return int(tokens * (saved.elements_per_token * element_bytes + saved.bytes_per_token)) + cast


def loss_bytes_per_element(element_bytes: int) -> int:
    """Bytes per logit at the loss's peak: the logits, their copy in the loss's dtype (fp32 at
    least; none when they have it), the shifted logits, their exponentials and the softmax."""
    loss = max(element_bytes, WEIGHT_BYTES)
    return element_bytes + (loss if loss != element_bytes else 0) + 3 * loss


def head_bytes(cfg: GPTConfig, *, tokens: int, tp: int = 1, element_bytes: int = WEIGHT_BYTES) -> int:
    """Bytes of the head's loss at its peak for one microbatch of `tokens` tokens."""
    return int(tokens * layer_saved(cfg, cfg.num_layers - 1, tp).workspace_per_token) * loss_bytes_per_element(
        element_bytes)


# ---- the planner's figures -------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PlannerFigures:
    """What the planner's memory check adds to the layers' own bytes (`templates.profile.MemoryModel`)."""

    grad_bytes_per_param: float
    """Gradient and exchange bytes per parameter, with the buckets' work buffers spread over them."""
    worker_bytes: int
    """Fixed bytes per worker: the norm's float64 chunk, the step count, two buckets' work buffers."""


def planner_figures(
    *, global_microbatches: int, min_pipelines: int = 1, max_pipelines: int = 1, partial_replay: bool = True,
    device_type: str = "cpu",
) -> PlannerFigures:
    """The largest figures over plans of `min_pipelines`..`max_pipelines` pipelines splitting the
    step's microbatches evenly (as far as they go: at most one pipeline per microbatch), on
    tensor-parallel rank 0 of a `device_type` device. Exact for one pipeline whose share is one
    block (a power of two); otherwise an upper bound for the even split: each bucket's fixed work
    buffers and padding are counted at their largest, spread over a full bucket beyond two."""
    if global_microbatches < 1 or min_pipelines < 1:
        raise ValueError(f"{global_microbatches} microbatches, {min_pipelines} pipelines")
    grad, worker = 0.0, 0
    for p in range(min_pipelines, max(min_pipelines, min(max_pipelines, global_microbatches)) + 1):
        # A holder's figures depend on its own blocks only through their number and tree levels
        # (the peers' count is the rest, the combine is of every holder's blocks): one holder of
        # each kind stands for all, and the split's blocks come as arrays (split_blocks.py).
        split = even_split_blocks(global_microbatches, p)
        total, scratch = len(split.starts), split.scratch()
        for blocks, levels in split.kinds():
            share = ShareCounts(pipelines=p, own_blocks=blocks, levels=levels, peer_blocks=total - blocks,
                                scratch=scratch, snapshot=partial_replay and p > 1)
            figures = holder_figures(share, device_type)
            grad = max(grad, figures.grad_bytes_per_param)
            worker = max(worker, figures.worker_bytes)
    return PlannerFigures(grad_bytes_per_param=grad, worker_bytes=worker)


def holder_figures(share: ShareLike, device_type: str = "cpu") -> PlannerFigures:
    """`planner_figures` of one holder in the tree `share`."""
    p = share.pipelines
    padding = (p - 1) * (GRAD_BYTES * share.copies + GRAD_BYTES * share.peer_blocks / p)
    fixed, per_param = _bucket_work_bound(share, device_type)
    bucket = fixed + padding
    loss = LOSS_BYTES if share.snapshot else 0
    return PlannerFigures(
        grad_bytes_per_param=grad_bytes_per_param(share) + per_param + bucket * GRAD_BYTES / BUCKET_BYTES,
        worker_bytes=worker_work_bytes(device_type) + loss + 2 * math.ceil(bucket),
    )


def _bucket_work_bound(share: ShareLike, device_type: str) -> tuple[float, float]:
    """(a, b): `bucket_work_bytes` of a bucket of n parameters is at most a + b x n."""
    if device_type in CHUNKED_DEVICE_TYPES:  # chunks of at most SUM_CHUNK elements: a constant
        return float(bucket_work_bytes(share.pipelines * SUM_CHUNK, share, device_type)), 0.0
    p = share.pipelines
    scratch = GRAD_BYTES * share.combine_scratch()  # slice-long buffers, a slice rounded up
    return scratch + (NORM_BYTES if share.measures and p > 1 else 0.0), scratch / p
