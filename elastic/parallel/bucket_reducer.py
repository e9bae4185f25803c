"""BucketReducer: the cross-pipeline reduction of one step's gradient buckets on one worker,
launched as the backward finishes each bucket and completed by `finalize_grads` (grad_sync.py).

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
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from elastic.comm import Handle
from elastic.parallel.blocks import Block, CombineProgram, combine, decompose
from elastic.parallel.buckets import BucketLayout, accum_buckets
from elastic.parallel.exchange import SUM_CHUNK, SecondPhase, TreeBucket, TreeExchange
from elastic.parallel.grad_accum import GradAccumulator
from elastic.parallel.groups import ParallelGroups
from elastic.parallel.layout import ParallelLayout, assign_ranks


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
    sharded: Mapping[tuple[str, ...], SecondPhase] | None = None
    """The sharded optimizer's second phases, by bucket (its parameter names, in flat order):
    each bucket named sends each element of my slice of its result only to the holders that
    update it, and receives only what I update (`engine/shard_reduce.py` `second_phases`); a bucket not
    named, or None, is all-gathered."""
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
    the exchange (valid once `wait()` returned): tensor-parallel rank 0, where every element of
    a bucket counts in the norm, and any rank of a bucket with a sharded second phase (its
    counted runs only)."""
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
        second = None if self.sharded is None else self.sharded.get(self.accum.flats[k][0])
        if self.layout.tp_rank == 0 or (second is not None and second.counted is not None):
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
            second=None if second is None else second.spans, counted=None if second is None else second.counted,
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
