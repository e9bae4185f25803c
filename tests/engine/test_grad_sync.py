"""The bucketed gradient reduction: bucket boundaries every holder agrees on, and the overlapped
reduction in the step's summation tree (three real gloo workers, threads of this process):
buckets are launched inside the last backward, and every holder ends with the tree-order sum of
every holder's block sums, bit for bit."""

from __future__ import annotations

import functools
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic.engine.step import StepTransaction
from elastic.model.config import get_preset
from elastic.model.gpt import GPTStage
from elastic.model.naming import layer_of
from elastic.parallel.blocks import Block
from elastic.parallel.bucket_reducer import BucketReducer
from elastic.parallel.buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES, bucket_layout, split_layers
from elastic.parallel.grad_sync import finalize_grads
from elastic.parallel.groups import build_groups
from elastic.parallel.layout import ParallelLayout, assign_ranks
from templates.plan import even_plan
from tests.comm.support import on_threads
from tests.engine.plans import hetero

pytestmark = pytest.mark.timeout(60)

CFG = get_preset("tiny")
LAYER_OF = functools.partial(layer_of, cfg=CFG)
SIZES = {name: p.numel() for name, p in GPTStage(CFG).named_parameters()}


def test_buckets_are_cut_as_ddp_cuts_them_a_first_of_1_mb_then_25_mb() -> None:
    mb = 2**20
    names = [f"l{i}" for i in range(10)]
    big = split_layers(tuple(range(10)), names, lambda n: int(n[1:]), {n: 10 * mb // 4 for n in names})
    # 10 MB per layer, filled from the last layer down: the first run closes at >= 1 MB (the
    # last layer alone), the others at >= 25 MB; what is left is the lowest run.
    assert big == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9,)]
    assert (mb, 25 * mb) == (FIRST_BUCKET_BYTES, BUCKET_BYTES)
    tiny = bucket_layout(list(SIZES), ParallelLayout.for_rank(even_plan(
        num_layers=6, nodes=[0, 1], num_pipelines=2, global_microbatches=4, microbatch_size=2), 0, 0), LAYER_OF, SIZES)
    # Tiny's float32 gradient is 3.3 MB: the head and the last block (0.9 MB) take the block
    # below to reach 1 MB; the rest is one run.
    assert [b.layers for b, _ in tiny] == [(0, 1, 2), (3, 4, 5)]
    first = sum(SIZES[n] for n in tiny[1][1]) * 4
    assert first >= FIRST_BUCKET_BYTES > first - 4 * sum(SIZES[n] for n in SIZES if LAYER_OF(n) == 3)
    assert sorted(n for _, names in tiny for n in names) == sorted(SIZES)
    assert all(b.ranks == (0, 1) for b, _ in tiny)


def test_every_holder_of_a_layout_bucket_cuts_it_alike() -> None:
    plan = hetero()
    per_rank = []
    for rank in range(len(assign_ranks(plan))):
        layout = ParallelLayout.for_rank(plan, 0, rank)
        first, last = layout.stage_plan.layers
        mine = [n for n in SIZES if first <= LAYER_OF(n) < last]
        per_rank.append(bucket_layout(mine, layout, LAYER_OF, SIZES))
    seen: dict[tuple[int, ...], list[tuple[tuple[int, ...], tuple[str, ...]]]] = {}
    for rank, buckets in enumerate(per_rank):
        groups: dict[tuple[int, ...], list[tuple[tuple[int, ...], tuple[str, ...]]]] = {}
        for bucket, names in buckets:
            assert rank in bucket.ranks
            groups.setdefault(bucket.ranks, []).append((bucket.layers, names))
        for ranks, runs in groups.items():
            assert seen.setdefault(ranks, runs) == runs, f"holders of {ranks} cut their buckets differently"
    assert len(seen) == 4  # the layout buckets of test_layout: (0,3), (1,3), (1,4), (2,4)


@pytest.mark.slow
@pytest.mark.parametrize("tree", [True, False])
def test_overlapped_reduction_is_the_tree_sum_on_every_holder(tree: bool) -> None:
    plan = even_plan(num_layers=6, nodes=[0, 1, 2], num_pipelines=3, global_microbatches=6, microbatch_size=2)
    store = dist.HashStore()

    def worker(rank: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int, float]:
        layout = ParallelLayout.for_rank(plan, 1, rank)
        groups = build_groups(layout, store, timeout=timedelta(seconds=30))
        module = GPTStage(CFG)
        accum = StepTransaction.buffers_for(module, layout=layout, layer_of=LAYER_OF, device=torch.device("cpu"))
        accum.attach(module)
        launched_in_backward = 0
        for step in range(2):  # the first step connects the peers; the second overlaps
            accum.begin([Block(2 * rank, 2)])  # pipeline p computes microbatches 2p and 2p + 1
            reducer = BucketReducer(accum=accum, layout=layout, groups=groups, layer_of=LAYER_OF, tree=tree)
            gen = torch.Generator().manual_seed(100 * rank + step)
            for m in range(2):
                tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=gen)
                loss = module.loss(module(tokens[:, :-1], dropout_key=None), tokens[:, 1:]) * (10.0 ** (rank - m))
                if m == 1:
                    reducer.arm()
                accum.leaf(2 * rank + m)
                loss.backward()
            launched_in_backward = reducer.early
            stats = finalize_grads(accum, layout=layout, groups=groups, layer_of=LAYER_OF, loss_sum=0.0,
                                   grad_clip=0.0, reducer=reducer)
        # The reduction left the sums as they were; its result is beside them.
        sums = accum.block_sums()[Block(2 * rank, 2)]
        return {n: t.clone() for n, t in sums.items()}, {n: t.clone() for n, t in accum.grads.items()}, \
            launched_in_backward, stats.grad_norm

    results = on_threads(3, worker)
    for r in results:
        assert not isinstance(r, BaseException), r
    launched = [r[2] for r in results]
    assert all(n >= 2 for n in launched), f"buckets launched inside the last backward: {launched}"
    for name in SIZES:
        if tree:  # leaves 0-5 of a tree of 8: ((0, 1) + (2, 3)) + (4, 5)
            expected = (results[0][0][name] + results[1][0][name]) + results[2][0][name]
            for r in results:
                assert torch.equal(r[1][name], expected), name
        else:
            expected32 = results[0][0][name] + results[1][0][name] + results[2][0][name]
            for r in results:
                torch.testing.assert_close(r[1][name], expected32, rtol=1e-5, atol=1e-7)
                assert torch.equal(r[1][name], results[0][1][name]), name
    # The vote's norm counts every element of the reduced gradient once (the tree: each holder
    # measured its slices in the exchange; gloo's all-reduce: the lowest-rank holder of each layer).
    reference = sum(results[0][1][name].double().square().sum().item() for name in SIZES) ** 0.5
    for r in results:
        assert r[3] == pytest.approx(reference, rel=1e-12)
