"""Interleaved templates: a p-node template re-cut into p * v virtual stages, v chunks per node.

Chunk c of node s holds virtual stage c * p + s (Narayanan et al., 2021). The cut is the one
that minimises the slowest virtual stage's forward and backward time, from the profile's layer
times (a min-max partition of the layers, exact by dynamic programming). Each node keeps its
template's recomputation mode for all its chunks.

Cost and memory (`templates.cost`):
- a node's time per microbatch is its chunks' times, each with the transfers of its output and
  gradient except the pipeline's last virtual stage: v times as many transfers as 1F1B;
- the step takes `pipeline_time(node times, m, v)`: the fill and drain shrink v-fold;
- a node holds the chunk-microbatches of its warm-up in flight, (p - s - 1) * 2 + (v - 1) * p
  + 1 of them, dealt in the schedule's order (chunk c of the first group of p, and so on);
  the first node holds the most, more than 1F1B's p: what interleaving costs.

`best_interleaving` takes, per template of 2 or more nodes, the v of 1..`MAX_CHUNKS` (or the one
forced) that fits every node's memory and is fastest at the template's microbatch count; a tie
keeps fewer chunks. A forced v that does not fit, or that the layers cannot split (p * v > L),
leaves the template at v = 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from templates.cost import StageCosts
from templates.search import PipelineTemplate

MAX_CHUNKS = 4
"""The largest v `auto` considers: past it the transfers grow faster than the bubble shrinks
on every profile tried (the bubble term falls as 1 / v, the transfers grow as v)."""


def balanced_cut(times: Sequence[float], parts: int) -> list[tuple[int, int]]:
    """`times` (per layer) cut into `parts` non-empty contiguous ranges so that the largest
    range total is least; ties go to the cut that ends each range earliest."""
    n = len(times)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} layers into {parts} non-empty parts")
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    inf = float("inf")
    # best[k][j]: least bottleneck of layers [0, j) in k parts; cut[k][j]: where part k starts.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    return list(zip(bounds, bounds[1:], strict=False))


def in_flight(num_stages: int, stage: int, chunks: int) -> list[int]:
    """Chunk-microbatches of each chunk that stage `stage` holds at its peak: its warm-up and
    one more, in the schedule table's order (groups of p microbatches, chunk by chunk)."""
    held = (num_stages - stage - 1) * 2 + (chunks - 1) * num_stages + 1
    counts = [0] * chunks
    for i in range(held):
        counts[(i // num_stages) % chunks] += 1
    return counts


def interleave_template(template: PipelineTemplate, costs: StageCosts, chunks: int) -> PipelineTemplate | None:
    """`template` with `chunks` model chunks per node, re-timed; None when the layers cannot be
    cut so or a node's memory does not hold it."""
    p, layers = template.num_nodes, costs.num_layers
    if chunks == 1:
        return template
    if p < 2 or p * chunks > layers:
        return None
    profile = costs.profile
    virtual = balanced_cut([ly.forward + ly.backward for ly in profile.layers], p * chunks)
    per_node = tuple(tuple(virtual[c * p + s] for c in range(chunks)) for s in range(p))
    times = []
    for s, (ranges, mode) in enumerate(zip(per_node, template.stage_modes, strict=True)):
        last = s == p - 1
        memory = costs.chunks_memory(ranges, mode, in_flight(p, s, chunks), last)
        if memory > costs.capacity:
            return None
        times.append(sum(costs.chunk_time(a, b, mode, last_virtual=last and c == chunks - 1)
                         for c, (a, b) in enumerate(ranges)))
    return dataclasses.replace(template, stages=tuple(rs[0] for rs in per_node), chunks=per_node,
                               stage_times=tuple(times), plain_stage_times=template.stage_times)


def best_interleaving(template: PipelineTemplate, costs: StageCosts, virtual_stages: int) -> PipelineTemplate:
    """`template` at the fastest v that fits (module doc); `virtual_stages` 0: any of
    1..MAX_CHUNKS, else that one (or 1 when it cannot be)."""
    if virtual_stages == 1:
        return template
    options = range(2, MAX_CHUNKS + 1) if virtual_stages == 0 else (virtual_stages,)
    best, m = template, template.microbatches
    for v in options:
        candidate = interleave_template(template, costs, v)
        if candidate is not None and (virtual_stages != 0 or candidate.time_for(m) < best.time_for(m) * (1 - 1e-9)):
            best = candidate
    return best
