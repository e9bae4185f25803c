"""Instantiation at cluster scale (templates/flat_knapsack.py and the split's fast start) against
plain references: a knapsack that tracks the pipeline count at every node count, and the greedy
split without its threshold.

The template sets are synthetic (sizes and stage times drawn at random): `choose_sizes` reads only
the templates' sizes and stage times, and synthetic sets reach node counts (hundreds) and
size gaps that real profiles of a few layers cannot.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from templates.cost import pipeline_time
from templates.instantiation import Timed, choose_sizes, split_microbatches
from templates.search import PipelineTemplate
from templates.template_set import TemplateSet
from tests.templates.helpers import SLOW_OR_FILTERED
from tests.templates.helpers import FakeTemplates as _Templates


@st.composite
def template_sets(draw: st.DrawFn) -> _Templates:
    sizes = draw(st.lists(st.integers(1, 14), min_size=1, max_size=7, unique=True))
    templates = {}
    for n in sizes:
        times = tuple(draw(st.lists(st.sampled_from([0.25, 0.5, 0.75, 1.0, 1.5, 2.5]), min_size=n, max_size=n)))
        templates[n] = PipelineTemplate(num_nodes=n, stages=tuple((i, i + 1) for i in range(n)),
                                        stage_times=times, microbatches=1)
    return _Templates(templates)


def reference_time(tset: _Templates, num_nodes: int, microbatches: int, need: int) -> float | None:
    """The least target time some multiset covering exactly `num_nodes` nodes with need..M
    pipelines reaches: a knapsack over (nodes, pipelines so far, capped at need), per target."""
    temps = [tset.templates[n] for n in tset.sizes]
    rest = [sum(t.stage_times) - t.bottleneck for t in temps]

    def feasible(target: float) -> bool:
        caps = [min(microbatches, math.floor((target * (1 + 1e-9) - a) / t.bottleneck + 1e-9))
                for a, t in zip(rest, temps, strict=True)]
        best = [[-1] * (need + 1) for _ in range(num_nodes + 1)]
        best[0][0] = 0
        for v in range(1, num_nodes + 1):
            for n, cap in zip(tset.sizes, caps, strict=True):
                if n > v or cap < 1:
                    continue
                for p, got in enumerate(best[v - n]):
                    if got >= 0:
                        q = min(need, p + 1)
                        best[v][q] = max(best[v][q], got + cap)
        return best[num_nodes][need] >= microbatches

    candidates = sorted({a + m * t.bottleneck for a, t in zip(rest, temps, strict=True)
                         for m in range(1, microbatches + 1)})
    lo, hi = 0, len(candidates) - 1
    if not feasible(candidates[hi]):
        return None
    while lo < hi:  # feasibility grows with the target
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if feasible(candidates[mid]) else (mid + 1, hi)
    return candidates[lo]


@pytest.mark.timeout(120)
@settings(max_examples=40, deadline=None, suppress_health_check=SLOW_OR_FILTERED)
@given(tset=template_sets(), extra=st.integers(0, 300), f=st.integers(0, 2), slack=st.integers(0, 40))
def test_cluster_scale_sizes_are_optimal(tset: _Templates, extra: int, f: int, slack: int) -> None:
    need = f + 1
    num_nodes = need * max(tset.sizes) + extra  # every cover has >= need pipelines: the flat knapsack
    microbatches = num_nodes // min(tset.sizes) + slack  # enough for any pipeline count
    reference = reference_time(tset, num_nodes, microbatches, need)
    if reference is None:
        return  # no multiset covers num_nodes exactly (sizes with a common factor)
    sizes = choose_sizes(cast(TemplateSet, tset), num_nodes, global_microbatches=microbatches, fault_tolerance=f)
    assert sum(sizes) == num_nodes and len(sizes) >= need
    temps = [tset.templates[n] for n in sizes]
    counts = split_microbatches(temps, microbatches)
    got = max(t.time_for(c) for t, c in zip(temps, counts, strict=True))
    assert got == pytest.approx(reference, rel=1e-9)


def greedy(templates: Sequence[Timed], total: int) -> list[int]:
    """The split one microbatch at a time, from one each (the definition)."""
    counts = [1] * len(templates)
    heap = [(t.time_for(2), p) for p, t in enumerate(templates)]
    heapq.heapify(heap)
    for _ in range(total - len(templates)):
        _, p = heapq.heappop(heap)
        counts[p] += 1
        heapq.heappush(heap, (templates[p].time_for(counts[p] + 1), p))
    return counts


class _Linear:
    def __init__(self, stage_times: tuple[float, ...]) -> None:
        self.stage_times = stage_times

    def time_for(self, microbatches: int) -> float:
        return pipeline_time(self.stage_times, microbatches)


@pytest.mark.timeout(60)
@settings(max_examples=80, deadline=None)
@given(
    kinds=st.lists(st.lists(st.sampled_from([0.25, 0.5, 1.0, 1.5, 3.0]), min_size=1, max_size=5),
                   min_size=1, max_size=4),
    picks=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    total_extra=st.integers(0, 2000),
)
def test_split_equals_the_greedy_one_at_a_time(kinds: list[list[float]], picks: list[int], total_extra: int) -> None:
    shared = [_Linear(tuple(k)) for k in kinds]  # pipelines of one template share the object
    templates = [shared[i % len(shared)] for i in picks]
    total = len(templates) + total_extra
    assert split_microbatches(templates, total) == greedy(templates, total)
