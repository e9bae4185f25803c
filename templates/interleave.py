"""Interleaved templates: a p-node template re-cut into p * v virtual stages, v chunks per node.

Chunk c of node s holds virtual stage c * p + s (Narayanan et al., 2021). The cut is the one
that minimises the slowest virtual stage's forward and backward time, from the profile's layer
times (a min-max partition of the layers, exact by dynamic programming). A forced
`--virtual-stages v` applies it to every template of at least 2 nodes whose layers allow p * v
non-empty chunks; the others keep v = 1. Memory is not re-checked here: a node holds about the
same layers as before, and the extra activations of interleaving are the planner's to count
(issue 53, part 2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from templates.profile import Profile
from templates.search import PipelineTemplate


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


def interleave_template(template: PipelineTemplate, profile: Profile, chunks: int) -> PipelineTemplate:
    """`template` with `chunks` model chunks per node (itself when it cannot: one node, or
    fewer layers than virtual stages)."""
    p = template.num_nodes
    if chunks == 1 or p < 2 or p * chunks > profile.num_layers:
        return template
    times = [layer.forward + layer.backward for layer in profile.layers]
    virtual = balanced_cut(times, p * chunks)
    per_node = tuple(tuple(virtual[c * p + s] for c in range(chunks)) for s in range(p))
    return dataclasses.replace(template, stages=tuple(rs[0] for rs in per_node), chunks=per_node)
