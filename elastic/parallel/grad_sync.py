"""finalize_grads: every non-obvious gradient reduction of a step, in one place.

Before this runs, each microbatch's loss was scaled by 1 / (global microbatch count) and its
gradient summed into a GradAccumulator, so a worker's sums are its pipeline's share of the
global-batch mean. Then:

1. Cross-pipeline sum per gradient bucket: every worker holding the same (layers, tp_rank)
   sums its bucket with the others. The sum of the pipelines' shares is the mean over the whole
   global batch, each microbatch weighted equally. A `BucketReducer` launches each bucket's
   reduction as soon as its sums are final (the last backward of the step added all of its
   gradients), in one global order (buckets by descending layer, the order a backward finishes
   them), so the reduction overlaps the rest of the backward as DDP's does; the waits happen
   here, each through `groups.wait` (StepAborted when the generation's abort flag is set).
2. The vote: one world all-reduce of the global gradient norm over all stages and
   tensor-parallel ranks (each gradient element counted once: a bucket the tree exchange
   reduced is measured by every holder, each its own slice of the result; any
   other bucket by its lowest-rank holder; replicated parameters only on tensor-parallel rank
   0, so on the other TP ranks it is measured per parameter after the reduction), the loss, a
   failure count and a halt count. A
   worker that sees it complete knows that every worker finished its reductions, so it may
   commit without asking anyone (see elastic/records/sync.py). If the vote's wait fails
   here, the reduced gradients are kept (VoteInterrupted): another worker may have seen it
   complete, and then this one must commit the same step during recovery.
3. Clip every gradient by the same factor (`clip_grads`, also used to complete such a step).

Wire format (the summation tree). A step's gradient is one fixed pairwise float32 sum over
its microbatches (elastic/parallel/blocks.py), the same bits whatever the plan. Each worker
sums its aligned blocks of that tree as the gradients arrive (grad_accum.py); a bucket is
reduced as a reduce-scatter of the blocks' float32 sums (each of the P holders gets every
holder's blocks of its 1/P slice and combines them in tree order) followed by an all-gather of
the slices: per worker 8 (P-1)/P bytes per element on the wire with one block per pipeline,
the bytes of DDP's float32 all-reduce (a pipeline whose share is not one aligned block sends a
slice per block). Both phases are point-to-point transfers on the bucket group, run by the
worker's `TreeExchange` on a thread of its own (elastic/parallel/exchange.py), so that neither
gloo's inline writes nor the second phase's wait and combine stall the backward. The result is
bit-identical on every plan, including one process with no reduction at all (its blocks are
combined the same way), which the re-plan, resume and partial-replay tests assert. Before it,
float64 sums reduced exactly gave the same guarantee at 1.5x the bytes at two pipelines; a
float32 all-reduce of each pipeline's share (`JobSpec.exact_grad_sum=False`, gloo's ring) has
DDP's bytes but a sum that depends on the number of pipelines and the ring order, and a run with
failures then drifts from the failure-free run as it goes on (2e-4 after 160 tiny steps,
measured: bench/README.md, "Engine vs DDP").

Buckets: a `GradBucket` of the layout (consecutive layers with the same holders) is split into
runs of whole layers as DDP splits its gradients: from the last layer down, the first run
closes at FIRST_BUCKET_BYTES of float32 gradient (1 MiB: it is launched early in the backward),
each later one at BUCKET_BYTES (25 MiB). The split depends only on the bucket's own layers, so
every holder splits it alike. More, smaller runs overlap more of the backward but each costs a
round of transfers: on this project's 2-core test machine, tiny (3.3 MB of gradient) cut into
three runs stepped 3 % slower than in DDP's two (bench/README.md, "Engine vs DDP").

Tensor-parallel replicated parameters (LayerNorm, row-parallel biases) need no reduction of
their own: with replicated activations their gradients are already equal on every TP rank.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from elastic.comm import Handle
from elastic.parallel.blocks import Block, CombineProgram, combine, decompose
from elastic.parallel.exchange import SUM_CHUNK, TreeBucket, TreeExchange
from elastic.parallel.grad_accum import GradAccumulator
from elastic.parallel.groups import ParallelGroups
from elastic.parallel.layout import GradBucket, ParallelLayout, assign_ranks
from elastic.parallel.phase_clock import StepPhases


@dataclass(frozen=True, kw_only=True)
class GradStats:
    """What the step learns from the global reduction."""

    grad_norm: float
    """Global gradient L2 norm before clipping."""
    loss: float
    """Mean loss over the global batch."""
    ok: bool
    """Whether every worker reported a usable step (finite gradients, no local error)."""
    halt: bool = False
    """Whether some worker asked the generation to halt after this step (all agree)."""
    phases: dict[int, StepPhases] = field(default_factory=dict)
    """Each plan node's forward, backward and wait seconds of the step (its tensor-parallel rank
    0's; elastic/parallel/phase_clock.py), carried by the vote; 0 where unmeasured."""


class VoteInterrupted(RuntimeError):
    """The vote's wait failed on this worker after its reductions completed: its gradients are
    reduced but not clipped, and kept for the control plane to commit or drop."""


BucketLayout = list[tuple[GradBucket, tuple[str, ...]]]
"""A worker's gradient buckets, each with the parameter names it holds (name order). Not a plan:
"plan" is the generation's parallel plan (`templates.plan.Plan`) that the buckets follow from."""


_UNMEASURED = StepPhases()

BUCKET_BYTES = 25 * 2**20
"""Target size of one gradient bucket in float32 bytes (DDP's bucket_cap_mb)."""
FIRST_BUCKET_BYTES = 2**20
"""Target size of a layout bucket's first run, the one its last layers fill (DDP's first
bucket): launched as early in the backward as can be, it starts the overlap."""


def bucket_layout(
    names: Sequence[str], layout: ParallelLayout, layer_of: Callable[[str], int],
    sizes: Mapping[str, int] | None = None,
) -> BucketLayout:
    """My gradient buckets with the parameter names each holds: the partition a GradAccumulator
    should be built with, so each bucket is one flat buffer. Ascending by layer. `sizes`
    (parameter name -> element count): split each layout bucket into runs of whole layers
    (`split_layers`); without it, one bucket per layout bucket."""
    out = []
    ordered = sorted(names)
    for bucket in layout.buckets:
        held = [name for name in ordered if layer_of(name) in set(bucket.layers)]
        runs = [bucket.layers] if sizes is None else split_layers(bucket.layers, held, layer_of, sizes)
        for run in runs:
            wanted = set(run)
            out.append((GradBucket(layers=run, ranks=bucket.ranks), tuple(n for n in held if layer_of(n) in wanted)))
    return out


def split_layers(
    layers: tuple[int, ...], names: Sequence[str], layer_of: Callable[[str], int], sizes: Mapping[str, int]
) -> list[tuple[int, ...]]:
    """`layers` cut into runs of consecutive layers, ascending: filled from the last layer down
    (the backward's order), the first closed once it holds FIRST_BUCKET_BYTES of float32
    gradient, each later one at BUCKET_BYTES (DDP's bucketing, in whole layers); a function of
    the layers' parameters only."""
    per_layer = {layer: 0 for layer in layers}
    for name in names:
        per_layer[layer_of(name)] += 4 * sizes[name]
    runs: list[tuple[int, ...]] = []
    run: list[int] = []
    held = 0
    for layer in reversed(layers):
        run.insert(0, layer)
        held += per_layer[layer]
        if held >= (BUCKET_BYTES if runs else FIRST_BUCKET_BYTES):
            runs.insert(0, tuple(run))
            run, held = [], 0
    if run:
        runs.insert(0, tuple(run))
    return runs


def accum_buckets(accum: GradAccumulator, layout: ParallelLayout, layer_of: Callable[[str], int]) -> BucketLayout:
    """The buckets `accum` was partitioned by (`StepTransaction.buffers_for`)."""
    return bucket_layout(list(accum.grads), layout, layer_of, {n: t.numel() for n, t in accum.grads.items()})


@dataclass(kw_only=True)
class BucketReducer:
    """The cross-pipeline reduction of one step's gradient buckets on one worker.

    `arm()` before the step's last backward: each bucket is launched once all of its gradients
    were added, in one global order (descending layer: every holder of a bucket group launches
    that group's buckets in the same order; launching never blocks, so no wait cycle can form).
    `launch_all()` launches the rest (parameters without a gradient in the last backward, a
    replayed step's kept sums added after the schedule); `wait()` completes every bucket, and
    `abandon()` gives the step's reductions up (a failure before `wait`). Results go to the
    accumulator's `reduced` buffers; the sums are only read, so they stay this worker's own for
    partial replay.

    With `tree` (the default) a bucket is reduced in the step's summation tree (see the module
    docstring) by the step's `TreeExchange`, on a thread of its own: launching one hands it
    over. Without, my blocks are combined and all-reduced by gloo (whose own thread does the
    transfers): the bytes are the same, the sum depends on the plan.
    """

    accum: GradAccumulator
    """The step's sums."""
    layout: ParallelLayout
    """My place in the plan."""
    groups: ParallelGroups
    """The generation's groups; every wait is abortable by `groups.abort`."""
    layer_of: Callable[[str], int]
    """Parameter name -> planning layer."""
    known: BucketLayout | None = None
    """`accum_buckets` of the accumulator, when the caller computed them already (a step
    transaction does once, not every step)."""
    exchange: TreeExchange | None = None
    """The exchange to hand buckets to, kept from step to step by the caller (its thread is kept
    with it); None: one of the reducer's own. Must not be abandoned."""
    tree: bool = True
    """Reduce in the step's summation tree (plan-independent); False: gloo's all-reduce."""
    blocks_of: Callable[[int], tuple[Block, ...]] | None = None
    """World rank -> the blocks it sends this step (every worker computes the same lists);
    None: those of the plan's pipelines (`plan_blocks`), a step without replay."""
    buckets: BucketLayout = field(init=False)
    """My buckets, ascending by layer."""
    order: list[int] = field(init=False)
    """Launch order: bucket indices by descending layer."""
    early: int = 0
    """Buckets launched inside the backward so far."""
    _flat_of: list[int] = field(init=False)
    _missing: list[int] = field(init=False)
    _bucket_of: dict[str, int] = field(init=False)
    _next: int = 0
    measured: dict[int, torch.Tensor] = field(default_factory=dict)
    """Accumulator group -> the sum of squares of my slice of its reduced gradient, measured by
    the exchange (valid once `wait()` returned): tensor-parallel rank 0 only, where every
    element of a bucket counts in the norm."""
    _reduced: set[int] = field(default_factory=set)
    _works: list[Handle] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.buckets = self.known if self.known is not None else accum_buckets(self.accum, self.layout, self.layer_of)
        self.order = sorted(range(len(self.buckets)), key=lambda i: -self.buckets[i][0].layers[0])
        self._missing = [len(names) for _, names in self.buckets]
        self._bucket_of = {n: i for i, (_, names) in enumerate(self.buckets) for n in names}
        index = {names: k for k, (names, _) in enumerate(self.accum.flats)}
        self._flat_of = [index.get(names, -1) for _, names in self.buckets]
        if self.exchange is None:
            self.exchange = TreeExchange()
        if self.blocks_of is None:
            self.blocks_of = plan_blocks(self.layout)

    def arm(self) -> None:
        """Launch buckets as their gradients arrive from now on (call before the last backward)."""
        self.accum.listener = self._added

    def _added(self, name: str) -> None:
        i = self._bucket_of[name]
        self._missing[i] -= 1
        abort = self.groups.abort
        while self._next < len(self.order) and self._missing[self.order[self._next]] <= 0:
            if abort is not None and abort.is_set():
                self.accum.listener = None  # finalize_grads launches the rest, abortably
                return
            self._launch(self.order[self._next])
            self.early += 1

    def launch_all(self) -> None:
        """Stop listening and launch every bucket not launched yet, in the global order."""
        self.accum.listener = None
        while self._next < len(self.order):
            self._launch(self.order[self._next])

    def _launch(self, i: int) -> None:
        self._next += 1
        bucket, _ = self.buckets[i]
        k = self._flat_of[i]
        if k < 0:  # no parameters of mine in this bucket
            return
        group = self.groups.bucket_group(bucket.ranks)
        if group is None:
            return
        sums = self.accum.sums(k)
        self._reduced.add(k)
        reduced = self.accum.reduced[k]
        if not self.tree:
            self._combine_mine(k, sums)
            self._works.append(group.all_reduce(reduced))
            return
        me = bucket.ranks.index(self.layout.rank)
        assert self.blocks_of is not None
        holders = tuple(self.blocks_of(r) for r in bucket.ranks)
        if holders[me] != self.accum.blocks:
            raise RuntimeError(f"rank {self.layout.rank} sums blocks {list(self.accum.blocks)} but the step's "
                               f"block lists give it {list(holders[me])}")
        length = reduced.numel() // len(bucket.ranks)
        chunk = torch.Size([_chunk(length, reduced.device)])
        program = _program(tuple(b for theirs in holders for b in theirs))
        norm = wide = None
        if self.layout.tp_rank == 0:
            norm = self.measured[k] = self._scratch(k, "norm", 0, torch.Size(), torch.float64)
            if reduced.device.type == "cpu":  # elsewhere the norm is one kernel, no buffer
                wide = self._scratch(k, "wide", 0, chunk, torch.float64)
        assert self.exchange is not None
        self.exchange.submit(TreeBucket(
            sums=tuple(sums), result=reduced, blocks=holders, group=group, me=me, tag=2 * bucket.layers[0],
            received=tuple(None if j == me else tuple(self._scratch(k, f"recv{j}", b, torch.Size([length]), self.accum.dtype)
                                                      for b in range(len(theirs)))
                           for j, theirs in enumerate(holders)),
            scratch=tuple(self._scratch(k, "tmp", t, chunk, self.accum.dtype) for t in range(program.scratch)),
            wide=wide, norm=norm, program=program,
        ))

    def _combine_mine(self, k: int, sums: list[torch.Tensor]) -> None:
        """My own blocks of group `k` (`sums`) combined in tree order into its reduced buffer."""
        reduced = self.accum.reduced[k]
        program = _program(self.accum.blocks)
        chunk = torch.Size([_chunk(reduced.numel(), reduced.device)])
        scratch = tuple(self._scratch(k, "tmp", t, chunk, self.accum.dtype) for t in range(program.scratch))
        combine(self.accum.blocks, sums, reduced, scratch, program=program)

    def wait(self) -> None:
        """Complete every launched reduction (abortably); a bucket nobody else holds gets my own
        blocks combined: reduced or not, every bucket ends as the step's tree-order sum."""
        assert self.exchange is not None
        try:
            for work in self._works:
                self.groups.wait(work)
            self.exchange.finish(self.groups.abort)
        except BaseException:
            self.abandon()
            raise
        for k in range(len(self.accum.flats)):
            if k not in self._reduced:
                self._combine_mine(k, self.accum.sums(k))
        self._works.clear()
        self._reduced.clear()

    def abandon(self) -> None:
        """Give up this step's reductions: nothing of them writes to the accumulator any more
        (transfers already posted may still complete)."""
        self.accum.listener = None
        if self._reduced and self.exchange is not None:
            self.exchange.abandon()

    def _scratch(self, k: int, purpose: str, index: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A work buffer kept in the accumulator across steps."""
        key = (k, purpose, index)
        buf = self.accum.scratch.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = self.accum.scratch[key] = torch.empty(shape, dtype=dtype, device=self.accum.reduced[k].device)
        return buf


def _chunk(length: int, device: torch.device) -> int:
    """Elements combined and measured at a time: SUM_CHUNK on CPU (cache-sized), the whole slice
    on an accelerator (each chunk costs a kernel launch per tree node)."""
    return min(length, SUM_CHUNK) if device.type == "cpu" else max(length, 1)


@functools.lru_cache(maxsize=256)
def _program(blocks: tuple[Block, ...]) -> CombineProgram:
    """The combine of `blocks` (a plan's few block lists recur every step)."""
    return CombineProgram(blocks)


def plan_blocks(layout: ParallelLayout) -> Callable[[int], tuple[Block, ...]]:
    """World rank -> the blocks its pipeline computes in a step of `layout`'s plan (no replay)."""
    plan = layout.plan
    by_pipeline = [decompose(range(plan.microbatch_offset(p), plan.microbatch_offset(p) + pipe.microbatches))
                   for p, pipe in enumerate(plan.pipelines)]
    pipeline_of = {w.rank: w.pipeline for w in assign_ranks(plan)}
    return lambda rank: by_pipeline[pipeline_of[rank]]


def finalize_grads(
    accum: GradAccumulator,
    *,
    layout: ParallelLayout,
    groups: ParallelGroups,
    layer_of: Callable[[str], int],
    loss_sum: torch.Tensor | float,
    grad_clip: float,
    ok: bool = True,
    halt: bool = False,
    reducer: BucketReducer | None = None,
    phases: StepPhases | Callable[[], StepPhases] = _UNMEASURED,
) -> GradStats:
    """Reduce, measure and clip the accumulated gradients of this worker's stage, in place.

    `loss_sum` is this worker's contribution to the global loss (the sum of its microbatch
    losses divided by the global microbatch count; 0 except on a last stage's TP rank 0), a
    float64 value that may stay on the device (read back with the vote); a non-finite one counts
    as a failure, like `ok=False`.
    Collective over every bucket group of mine and then the world group; every wait goes
    through `groups.wait` (StepAborted when the generation's abort flag is set); a failure of
    the vote's wait raises VoteInterrupted with the gradients reduced and unclipped. `halt`:
    this worker's wish to stop after this step, summed into the vote. `reducer`: the step's
    BucketReducer when some buckets were launched during the backward (default: a new one).
    `phases`: this worker's forward, backward and wait seconds of the step (or what reads them,
    right before the vote: an accelerator's timing events are waited for then); the vote carries
    three slots per plan node (tensor-parallel rank 0 fills its node's), 24 bytes a node, and
    every worker learns them all.
    """
    grads = accum.grads
    params = dict(accum.named)

    # 1. Cross-pipeline bucket reduction: launch what the backward did not, wait for all.
    if reducer is None:
        reducer = BucketReducer(accum=accum, layout=layout, groups=groups, layer_of=layer_of)
    reducer.launch_all()
    reducer.wait()
    buckets = reducer.buckets

    # 2. Global norm (each element once), loss and the ok flag in one world all-reduce.
    device = next(iter(grads.values())).device
    sq = torch.zeros((), dtype=torch.float64, device=device)
    wide = accum.scratch.get((-1, "norm", 0))
    if wide is None and device.type == "cpu":
        wide = accum.scratch[(-1, "norm", 0)] = torch.empty(_NORM_CHUNK, dtype=torch.float64, device=device)
    for bucket, names in buckets:
        if not names:
            continue
        k = accum.group_of(names[0])
        measured = reducer.measured.get(k)
        if measured is not None:  # my slice, measured by the exchange (every holder adds its own)
            sq += measured
            continue
        if not layout.counts_layer_for_norm(bucket.layers[0]):
            continue
        if layout.tp_rank == 0:
            sq += sum_of_squares(accum.reduced[k], wide)
        else:  # replicated parameters are counted on TP rank 0 only
            for name in names:
                if getattr(params[name], "tp_dim", None) is not None:
                    sq += sum_of_squares(grads[name], wide)
    loss_t = torch.as_tensor(loss_sum, dtype=torch.float64, device=device)
    failed = (~torch.isfinite(loss_t)).to(torch.float64) if ok else torch.ones((), dtype=torch.float64, device=device)
    nodes = layout.plan.nodes
    flags = torch.tensor([1.0 if halt else 0.0], dtype=torch.float64)
    stats = torch.cat([torch.stack([sq, loss_t, failed]), torch.cat([flags, _phase_slots(layout, phases)]).to(device)])
    try:
        groups.wait(groups.world.all_reduce(stats))
        total_sq, loss, failures, halts, *timed_all = groups.fetch(stats).tolist()
    except Exception as exc:
        raise VoteInterrupted(f"the vote's wait failed: {type(exc).__name__}: {exc}") from exc
    norm = math.sqrt(total_sq)
    usable = failures == 0 and math.isfinite(norm)

    # 3. Clip by one factor everywhere.
    if usable:
        clip_grads(accum, grad_norm=norm, grad_clip=grad_clip)
    seconds = {n: StepPhases(*timed_all[3 * i : 3 * i + 3]) for i, n in enumerate(nodes)}
    return GradStats(grad_norm=norm, loss=loss, ok=usable, halt=halts > 0, phases=seconds)


def _phase_slots(layout: ParallelLayout, phases: StepPhases | Callable[[], StepPhases]) -> torch.Tensor:
    """The vote's three slots per plan node (forward, backward, wait), this node's filled on its
    tensor-parallel rank 0 (read there, right before the vote), every other slot 0."""
    nodes = layout.plan.nodes
    timed = torch.zeros((len(nodes), 3), dtype=torch.float64)
    if layout.tp_rank == 0:
        mine = phases() if callable(phases) else phases
        timed[nodes.index(layout.node)] = torch.tensor(mine.values(), dtype=torch.float64)
    return timed.flatten()


def clip_grads(accum: GradAccumulator, *, grad_norm: float, grad_clip: float) -> None:
    """Scale every reduced gradient by the clip factor of `grad_norm` (the same everywhere)."""
    if grad_clip > 0 and grad_norm > grad_clip:
        coef = grad_clip / (grad_norm + 1e-6)
        for reduced in accum.reduced:
            reduced.mul_(coef)


_NORM_CHUNK = 1 << 18
"""Elements widened to float64 at a time for a sum of squares (a 2 MiB scratch)."""


def sum_of_squares(t: torch.Tensor, wide: torch.Tensor | None) -> torch.Tensor:
    """The sum of `t`'s squared elements accumulated in float64, one chunk at a time through the
    float64 scratch `wide`: no full-size temporary (whose page faults cost more than the sum),
    and unlike a float32 dot product no float32 accumulator. Without `wide` (an accelerator):
    one float64 norm over the whole tensor, one kernel."""
    if wide is None:
        return torch.linalg.vector_norm(t, dtype=torch.float64).square()
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for chunk in t.reshape(-1).split(wide.numel()):
        w = wide[: chunk.numel()]
        w.copy_(chunk)
        total += torch.dot(w, w)
    return total
