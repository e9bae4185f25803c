"""Instantiation with fewer microbatches than N / n0 (templates/counted_knapsack.py) against the
counting knapsack it replaced on that path (`_SizeSearch._knapsack` driven by `_ladder_sizes`):
the same sizes, tie for tie, or the same refusal; and the memo of `choose_sizes`.

The template sets are synthetic (sizes, stage times and chunk counts drawn at random):
`choose_sizes` reads only the templates' sizes, stage times and chunk counts.
"""

from __future__ import annotations

import random
from typing import cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.planning.cluster import ClusterSpec, cluster_templates
from templates.counted_knapsack import Counted, Layers, relaxation_allows
from templates.instantiation import _ladder_sizes, _SizeSearch, choose_sizes
from templates.search import PipelineTemplate
from templates.template_set import PlanningError, SizesMemo, TemplateSet
from tests.templates.helpers import SLOW_OR_FILTERED
from tests.templates.helpers import FakeTemplates as _Templates


def _template(n: int, times: tuple[float, ...], chunks: int) -> PipelineTemplate:
    ranges = tuple(tuple((c, c + 1) for c in range(chunks)) for _ in range(n)) if chunks > 1 else ()
    return PipelineTemplate(num_nodes=n, stages=tuple((i, i + 1) for i in range(n)), stage_times=times,
                            microbatches=1, chunks=ranges)


@st.composite
def template_sets(draw: st.DrawFn) -> _Templates:
    sizes = draw(st.lists(st.integers(1, 12), min_size=1, max_size=7, unique=True))
    templates = {}
    for n in sizes:
        times = tuple(draw(st.lists(st.sampled_from([0.25, 0.5, 0.75, 1.0, 1.5, 2.5]), min_size=n, max_size=n)))
        chunks = draw(st.sampled_from([1, 1, 2, 3])) if n > 1 else 1
        templates[n] = _template(n, times, chunks)
    return _Templates(templates)


def reference(tset: _Templates, num_nodes: int, microbatches: int, f: int) -> list[int] | None:
    """The sizes the table over every (nodes, pipelines, target) picks (None: no cover)."""
    found = _ladder_sizes(_SizeSearch(cast(TemplateSet, tset), num_nodes, microbatches, f + 1))
    return None if found is None else sorted(found, reverse=True)


def chosen(tset: _Templates, num_nodes: int, microbatches: int, f: int) -> list[int] | None:
    try:
        return choose_sizes(cast(TemplateSet, tset), num_nodes, global_microbatches=microbatches, fault_tolerance=f)
    except PlanningError:
        return None


@pytest.mark.timeout(240)
@settings(max_examples=150, deadline=None, suppress_health_check=SLOW_OR_FILTERED)
@given(tset=template_sets(), num_nodes=st.integers(1, 160), f=st.integers(0, 2), share=st.floats(0.02, 0.99))
def test_counted_sizes_equal_the_full_table(tset: _Templates, num_nodes: int, f: int, share: float) -> None:
    most = num_nodes // tset.min_nodes  # the most pipelines a cover can have
    microbatches = max(f + 1, min(most - 1, round(share * most)))
    if num_nodes < (f + 1) * tset.min_nodes or microbatches >= most:
        return  # refused before any knapsack, or the pipeline count is capped: not this path
    assert not _SizeSearch(cast(TemplateSet, tset), num_nodes, microbatches, f + 1).capped
    assert chosen(tset, num_nodes, microbatches, f) == reference(tset, num_nodes, microbatches, f)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("seed", range(6))
def test_counted_sizes_equal_the_full_table_at_hundreds_of_nodes(seed: int) -> None:
    """Real-like shapes: contiguous sizes from n0 up, stage times falling with the depth, and
    a few hundred nodes with a batch of a fraction of the pipelines: many ties to break."""
    rng = random.Random(seed)
    n0 = rng.randint(1, 3)
    templates = {}
    for n in range(n0, n0 + rng.randint(4, 12)):
        per_stage = 1.0 / n + rng.choice([0.0, 0.01, 0.05])
        times = tuple(round(per_stage * rng.choice([1.0, 1.0, 1.1, 1.3]), 2) + 0.01 * s for s in range(n))
        templates[n] = _template(n, times, rng.choice([1, 1, 2]) if n > 1 else 1)
    tset = _Templates(templates)
    for _ in range(4):
        num_nodes = rng.randint(100, 400)
        # About one microbatch per pipeline of a few nodes: many covers tie.
        for microbatches in (rng.randint(2, num_nodes // n0 - 1), num_nodes // (n0 + rng.randint(1, 3))):
            assert chosen(tset, num_nodes, microbatches, 1) == reference(tset, num_nodes, microbatches, 1)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("batch", "live"), [(256, 256), (256, 255), (256, 253), (128, 255)])
def test_counted_sizes_equal_the_full_table_for_a_real_model(batch: int, live: int) -> None:
    """gpt3-6.7b on 256 nodes of 8 devices, a microbatch of 4: one microbatch per pipeline of
    about four nodes, and covers of the same count and speed (1 + 4 + ... or 2 + 3 + ...)."""
    spec = ClusterSpec(model="gpt3-6.7b", nodes=256, gpus_per_node=8, fault_tolerance=1, global_batch=batch,
                       microbatch=4, virtual_stages=0)
    tset = cluster_templates(spec)
    microbatches = spec.global_microbatches
    got = choose_sizes(tset, live, global_microbatches=microbatches, fault_tolerance=1)
    assert got == sorted(_ladder_sizes(_SizeSearch(tset, live, microbatches, 2)) or [], reverse=True)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=5, unique=True),
       caps=st.lists(st.integers(0, 6), min_size=5, max_size=5),
       num_nodes=st.integers(1, 60), need=st.integers(1, 3), microbatches=st.integers(1, 40))
def test_the_relaxation_rules_out_only_unreachable_targets(
    sizes: list[int], caps: list[int], num_nodes: int, need: int, microbatches: int
) -> None:
    problem = Counted(sizes=np.array(sorted(sizes), dtype=np.int64), num_nodes=num_nodes, need=need,
                      microbatches=max(need, microbatches))
    cap = np.array(caps[: len(sizes)], dtype=np.int64)
    layers = Layers(problem, cap)
    if not relaxation_allows(problem, cap):
        assert layers.reached is None
    if layers.reached is not None:  # the unwound multiset is a witness
        got = layers.sizes()
        index = {s: i for i, s in enumerate(sorted(sizes))}
        assert sum(got) == num_nodes and len(got) == layers.reached
        assert need <= len(got) <= problem.microbatches
        assert sum(int(cap[index[s]]) for s in got) >= problem.microbatches
        assert all(cap[index[s]] >= 1 for s in got)


def test_choose_sizes_remembers_answers_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    import templates.instantiation as inst

    tset = _Templates({n: _template(n, (1.0,) * n, 1) for n in (2, 3, 5)})
    calls: list[int] = []
    real = inst._fastest_sizes

    def counting(*args: object) -> list[int]:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(inst, "_fastest_sizes", counting)
    first = chosen(tset, 40, 9, 1)
    assert first is not None and chosen(tset, 40, 9, 1) == first and len(calls) == 1
    first.append(99)  # the caller's list is its own
    assert chosen(tset, 40, 9, 1) == first[:-1]
    even = _Templates({n: _template(n, (1.0,) * n, 1) for n in (2, 4)})
    with pytest.raises(PlanningError, match="cannot be split exactly") as refused:
        choose_sizes(cast(TemplateSet, even), 7, global_microbatches=2, fault_tolerance=0)
    with pytest.raises(PlanningError) as again:
        choose_sizes(cast(TemplateSet, even), 7, global_microbatches=2, fault_tolerance=0)
    assert str(again.value) == str(refused.value) and len(calls) == 2


def test_the_memo_keeps_the_most_recently_used() -> None:
    memo = SizesMemo(capacity=2)
    memo.put((1, 1, 0), (1,))
    memo.put((2, 1, 0), (2,))
    assert memo.get((1, 1, 0)) == (1,)  # now the most recent
    memo.put((3, 1, 0), (3,))
    assert memo.get((2, 1, 0)) is None and memo.get((1, 1, 0)) == (1,) and len(memo) == 2
