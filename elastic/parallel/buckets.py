"""A worker's gradient buckets: which parameters are reduced together, one flat buffer each.

A `GradBucket` of the layout (plan_ranks.py: consecutive layers with the same holders) is split into
runs of whole layers as DDP splits its gradients: from the last layer down, the first run
closes at FIRST_BUCKET_BYTES of float32 gradient (1 MiB: it is launched early in the backward),
each later one at BUCKET_BYTES (25 MiB). The split depends only on the bucket's own layers, so
every holder splits it alike. More, smaller runs overlap more of the backward but each costs a
round of transfers: on this project's 2-core test machine, tiny (3.3 MB of gradient) cut into
three runs stepped 3 % slower than in DDP's two (bench/README.md, "Engine vs DDP").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from elastic.parallel.grad_accum import GradAccumulator
from elastic.parallel.layout import ParallelLayout
from elastic.parallel.plan_ranks import GradBucket

BucketLayout = list[tuple[GradBucket, tuple[str, ...]]]
"""A worker's gradient buckets, each with the parameter names it holds (name order). Not a plan:
"plan" is the generation's parallel plan (`templates.plan.Plan`) that the buckets follow from."""

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
