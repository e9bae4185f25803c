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
   tensor-parallel ranks (each gradient element counted once: one holder per layer, replicated
   parameters only on tensor-parallel rank 0), the loss, a failure count and a halt count. A
   worker that sees it complete knows that every worker finished its reductions, so it may
   commit without asking anyone (see elastic/records/protocol.py). If the vote's wait fails
   here, the reduced gradients are kept (VoteInterrupted): another worker may have seen it
   complete, and then this one must commit the same step during recovery.
3. Clip every gradient by the same factor (`clip_grads`, also used to complete such a step).

Wire format (float64 sums). The float64 sums make the gradient independent of how the plan
splits microbatches across pipelines (see grad_accum.py), and the optimizer only ever sees them
rounded to float32. So a bucket is reduced as a float64 reduce-scatter (each of the P holders
gets the exact sum of its 1/P slice) followed by a float32 all-gather of the slices, each rounded
once: per worker 12 (P-1)/P bytes per element on the wire, against 16 (P-1)/P for the float64
all-reduce it replaces and 8 (P-1)/P for a float32 one (gloo's own reduce-scatter is slower than
its all-reduce, so both phases are point-to-point transfers on the bucket group,
`BucketReducer`). The result is bit-identical on every plan, including one process with no
reduction at all (every bucket is rounded the same way there), which the re-plan, resume and
partial-replay tests assert. The cheaper alternative, rounding each pipeline's share to float32
and all-reducing float32 (the bytes of DDP), makes the sum depend on the number of pipelines and
gloo's ring order, and a run with failures then drifts from the failure-free run as it goes on
(2e-4 after 160 tiny steps, measured: bench/README.md, "Engine vs DDP"); it would save the last
third of the bytes, which the overlap with the backward partly hides
(`bench/engine_vs_ddp.py`'s float32-sums row is roughly that scheme's speed). Measured on
loopback (2 processes, the tiny model's 867k elements, a loaded 2-core machine): gloo float64 all-reduce 5.5-8 ms, float32 2-4 ms, this
exchange 7-10 ms: on loopback bytes cost CPU copies, not bandwidth, and the exchange has two
round trips, so the saving is for real networks; in the engine benchmark the two float64
schemes were within noise of each other. On that 2-core machine the overlap itself measured
nothing either (on/off within noise: two single-threaded workers already fill both cores, and
loopback transfers are CPU copies that compete with the backward): tiny, 2 processes, the engine
took 56-60 ms a step against main's 55-56 ms and DDP's 48-52 ms. Float32 sums (`JobSpec.exact_grad_sum=False`) are
all-reduced as float32.

Buckets: a `GradBucket` of the layout (consecutive layers with the same holders) is split into
runs of whole layers of about `BUCKET_BYTES` of float32 gradient (DDP's 25 MB), or of about a
`MIN_BUCKETS`-th of it when it is smaller, so that a small model still overlaps (tiny: 3 runs).
The split depends only on the bucket's own layers, so every holder splits it alike.

Tensor-parallel replicated parameters (LayerNorm, row-parallel biases) need no reduction of
their own: with replicated activations their gradients are already equal on every TP rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from elastic.parallel.grad_accum import GradAccumulator
from elastic.parallel.groups import ParallelGroups
from elastic.parallel.layout import GradBucket, ParallelLayout


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


class VoteInterrupted(RuntimeError):
    """The vote's wait failed on this worker after its reductions completed: its gradients are
    reduced but not clipped, and kept for the control plane to commit or drop."""


BucketLayout = list[tuple[GradBucket, tuple[str, ...]]]
"""A worker's gradient buckets, each with the parameter names it holds (name order). Not a plan:
"plan" is the generation's parallel plan (`templates.plan.Plan`) that the buckets follow from."""


BUCKET_BYTES = 25 * 2**20
"""Target size of one gradient bucket in float32 bytes (DDP's bucket_cap_mb)."""
MIN_BUCKETS = 4
"""A layout bucket smaller than MIN_BUCKETS x BUCKET_BYTES is cut into runs of about a
MIN_BUCKETS-th of it (whole layers: fewer when layers are uneven), so that even a small model's
reduction overlaps its backward."""


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
    (the backward's order), each closed once it holds min(BUCKET_BYTES, total / MIN_BUCKETS)
    float32 bytes; a function of the layers' parameters only."""
    per_layer = {layer: 0 for layer in layers}
    for name in names:
        per_layer[layer_of(name)] += 4 * sizes[name]
    target = min(BUCKET_BYTES, max(1, sum(per_layer.values()) // MIN_BUCKETS))
    runs: list[tuple[int, ...]] = []
    run: list[int] = []
    held = 0
    for layer in reversed(layers):
        run.insert(0, layer)
        held += per_layer[layer]
        if held >= target:
            runs.insert(0, tuple(run))
            run, held = [], 0
    if run:
        runs.insert(0, tuple(run))
    return runs


def accum_buckets(accum: GradAccumulator, layout: ParallelLayout, layer_of: Callable[[str], int]) -> BucketLayout:
    """The buckets `accum` was partitioned by (`StepTransaction.buffers_for`)."""
    return bucket_layout(list(accum.grads), layout, layer_of, {n: t.numel() for n, t in accum.grads.items()})


@dataclass(kw_only=True)
class _Reduction:
    """One bucket's reduction in flight: a float32 all-reduce, or the two phases of the exact
    float64 one (`BucketReducer._launch`)."""

    flat: torch.Tensor
    """The bucket's flat sums (overwritten by the result)."""
    works: list[dist.Work]
    """Operations of the current phase."""
    group: dist.ProcessGroup | None = None
    """The bucket group (None: a float32 all-reduce)."""
    me: int = 0
    """My rank in the bucket group."""
    tag: int = 0
    """Tag of the first phase (the second uses tag + 1): twice the bucket's first layer."""
    k: int = 0
    """Index of the bucket's group in the accumulator (its scratch buffers' key)."""
    received: dict[int, torch.Tensor] = field(default_factory=dict)
    """Peer -> its float64 sums of my slice (first phase)."""
    result: torch.Tensor | None = None
    """The bucket's reduced gradient (`GradAccumulator.reduced`): my slice computed, the others
    received (second phase)."""


@dataclass(kw_only=True)
class BucketReducer:
    """The cross-pipeline reduction of one step's gradient buckets on one worker.

    `arm()` before the step's last backward: each bucket is launched once all of its gradients
    were added, in one global order (descending layer: every holder of a bucket group launches
    that group's buckets in the same order; launching never blocks, so no wait cycle can form).
    `launch_all()` launches the rest (parameters without a gradient in the last backward, a
    replayed step's kept sums added after the schedule, a bucket whose peers are not connected
    yet); `wait()` completes every bucket. Results go to the accumulator's `reduced` buffers;
    the sums are only read, so they stay this worker's own for partial replay.

    Float64 sums are reduced exactly with float32 results (see the module docstring): with P
    holders and the flat buffer cut into P equal slices, every holder sends slice j to holder j
    and receives its own slice from every other (float64, point-to-point on the bucket group,
    all posted at once), sums it in holder order, rounds it to float32 and sends that to every
    other holder, which receive the other slices likewise. Ring bytes are those of a
    reduce-scatter + all-gather (gloo's own reduce-scatter is slower than its all-reduce).
    """

    accum: GradAccumulator
    """The step's sums."""
    layout: ParallelLayout
    """My place in the plan."""
    groups: ParallelGroups
    """The generation's groups; every wait goes through `groups.wait`."""
    layer_of: Callable[[str], int]
    """Parameter name -> planning layer."""
    known: BucketLayout | None = None
    """`accum_buckets` of the accumulator, when the caller computed them already (a step
    transaction does once, not every step)."""
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
    _flight: list[_Reduction] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.buckets = self.known if self.known is not None else accum_buckets(self.accum, self.layout, self.layer_of)
        self.order = sorted(range(len(self.buckets)), key=lambda i: -self.buckets[i][0].layers[0])
        self._missing = [len(names) for _, names in self.buckets]
        self._bucket_of = {n: i for i, (_, names) in enumerate(self.buckets) for n in names}
        index = {names: k for k, (names, _) in enumerate(self.accum.flats)}
        self._flat_of = [index.get(names, -1) for _, names in self.buckets]

    def arm(self) -> None:
        """Launch buckets as their gradients arrive from now on (call before the last backward)."""
        self.accum.listener = self._added

    def _added(self, name: str) -> None:
        i = self._bucket_of[name]
        self._missing[i] -= 1
        abort = self.groups.abort
        while self._next < len(self.order) and self._missing[self.order[self._next]] <= 0:
            if (abort is not None and abort.is_set()) or not self._connected(self.order[self._next]):
                self.accum.listener = None  # finalize_grads launches the rest, abortably
                return
            self._launch(self.order[self._next])
            self.early += 1

    def _connected(self, i: int) -> bool:
        """Whether posting bucket `i`'s transfers cannot block (its peers are connected), so it
        may be launched inside the backward."""
        bucket, _ = self.buckets[i]
        group = self.groups.bucket_group(bucket.ranks)
        if group is None or self.accum.dtype != torch.float64:
            return True
        me = bucket.ranks.index(self.layout.rank)
        return all((id(group), j) in self.groups.connected for j in range(len(bucket.ranks)) if j != me)

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
        self.accum.settle(k)
        flat = self.accum.flats[k][1]
        if flat.dtype != torch.float64:
            reduced = self.accum.reduced[k]
            reduced.copy_(flat)
            work = dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group, async_op=True)
            assert work is not None
            self._flight.append(_Reduction(flat=flat, works=[work], k=k, result=reduced))
            return
        r = _Reduction(flat=flat, works=[], group=group, me=bucket.ranks.index(self.layout.rank),
                       tag=2 * bucket.layers[0], k=k)
        slices = flat.chunk(len(bucket.ranks))
        for j in range(len(bucket.ranks)):
            if j != r.me:
                r.received[j] = self._scratch(k, "recv", j, slices[r.me].shape, flat.dtype)
                r.works.append(self.groups.p2p("recv", r.received[j], j, r.tag, group=group))
                r.works.append(self.groups.p2p("send", slices[j], j, r.tag, group=group))
        self._flight.append(r)

    def wait(self) -> None:
        """Complete every launched reduction (abortably); the sums of a bucket nobody else holds
        are rounded into its `reduced` buffer as they are: reduced or not, every bucket ends as
        the once-rounded exact sum."""
        for r in self._flight:  # launch order
            self.groups.wait_all(r.works)
            if r.group is not None:
                self._exchange_result(r)
            else:
                r.works = []
        self.groups.wait_all([work for r in self._flight for work in r.works])
        reduced = {r.k for r in self._flight}
        for k, (_, flat) in enumerate(self.accum.flats):
            if k not in reduced:
                self.accum.settle(k)
                self.accum.reduced[k].copy_(flat)
        self._flight.clear()

    def _scratch(self, k: int, purpose: str, peer: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A work buffer kept in the accumulator across steps."""
        key = (k, purpose, peer)
        buf = self.accum.scratch.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = self.accum.scratch[key] = torch.empty(shape, dtype=dtype, device=self.accum.flats[k][1].device)
        return buf

    def _exchange_result(self, r: _Reduction) -> None:
        """Second phase: sum my slice over the holders in holder order, round it to float32,
        send it to every other holder and post the receives of theirs."""
        assert r.group is not None
        slices = r.flat.chunk(len(r.received) + 1)
        total = self._scratch(r.k, "sum", 0, slices[r.me].shape, r.flat.dtype)
        parts = [slices[j] if j == r.me else r.received[j] for j in range(len(slices))]
        torch.add(parts[0], parts[1], out=total)
        for part in parts[2:]:
            total.add_(part)
        r.result = self.accum.reduced[r.k]
        results = r.result.chunk(len(slices))
        results[r.me].copy_(total)
        r.works = []
        for j in range(len(slices)):
            if j != r.me:
                r.works.append(self.groups.p2p("recv", results[j], j, r.tag + 1, group=r.group))
                r.works.append(self.groups.p2p("send", results[r.me], j, r.tag + 1, group=r.group))


def finalize_grads(
    accum: GradAccumulator,
    *,
    layout: ParallelLayout,
    groups: ParallelGroups,
    layer_of: Callable[[str], int],
    loss_sum: float,
    grad_clip: float,
    ok: bool = True,
    halt: bool = False,
    reducer: BucketReducer | None = None,
) -> GradStats:
    """Reduce, measure and clip the accumulated gradients of this worker's stage, in place.

    `loss_sum` is this worker's contribution to the global loss (the sum of its microbatch
    losses divided by the global microbatch count; 0 except on a last stage's TP rank 0).
    Collective over every bucket group of mine and then the world group; every wait goes
    through `groups.wait` (StepAborted when the generation's abort flag is set); a failure of
    the vote's wait raises VoteInterrupted with the gradients reduced and unclipped. `halt`:
    this worker's wish to stop after this step, summed into the vote. `reducer`: the step's
    BucketReducer when some buckets were launched during the backward (default: a new one).
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
    if wide is None:
        wide = accum.scratch[(-1, "norm", 0)] = torch.empty(_NORM_CHUNK, dtype=torch.float64, device=device)
    for bucket, names in buckets:
        if not names or not layout.counts_layer_for_norm(bucket.layers[0]):
            continue
        if layout.tp_rank == 0:
            sq += sum_of_squares(accum.reduced[accum.group_of(names[0])], wide)
        else:  # replicated parameters are counted on TP rank 0 only
            for name in names:
                if getattr(params[name], "tp_dim", None) is not None:
                    sq += sum_of_squares(grads[name], wide)
    stats = torch.stack(
        [
            sq,
            torch.tensor(loss_sum, dtype=torch.float64, device=device),
            torch.tensor(0.0 if ok else 1.0, dtype=torch.float64, device=device),
            torch.tensor(1.0 if halt else 0.0, dtype=torch.float64, device=device),
        ]
    )
    try:
        groups.wait(dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=groups.world, async_op=True))
    except Exception as exc:
        raise VoteInterrupted(f"the vote's wait failed: {type(exc).__name__}: {exc}") from exc
    total_sq, loss, failures, halts = stats.tolist()
    norm = math.sqrt(total_sq)
    usable = failures == 0 and math.isfinite(norm)

    # 3. Clip by one factor everywhere.
    if usable:
        clip_grads(accum, grad_norm=norm, grad_clip=grad_clip)
    return GradStats(grad_norm=norm, loss=loss, ok=usable, halt=halts > 0)


def clip_grads(accum: GradAccumulator, *, grad_norm: float, grad_clip: float) -> None:
    """Scale every reduced gradient by the clip factor of `grad_norm` (the same everywhere)."""
    if grad_clip > 0 and grad_norm > grad_clip:
        coef = grad_clip / (grad_norm + 1e-6)
        for reduced in accum.reduced:
            reduced.mul_(coef)


_NORM_CHUNK = 1 << 18
"""Elements widened to float64 at a time for a sum of squares (a 2 MiB scratch)."""


def sum_of_squares(t: torch.Tensor, wide: torch.Tensor) -> torch.Tensor:
    """The sum of `t`'s squared elements accumulated in float64, one chunk at a time through the
    float64 scratch `wide`: no full-size temporary (whose page faults cost more than the sum),
    and unlike a float32 dot product no float32 accumulator."""
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for chunk in t.reshape(-1).split(wide.numel()):
        w = wide[: chunk.numel()]
        w.copy_(chunk)
        total += torch.dot(w, w)
    return total
