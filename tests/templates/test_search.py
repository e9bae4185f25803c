"""Template search: exact against exhaustive search; stage layouts well-formed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from templates.cost import StageCosts
from templates.profile import Profile
from templates.search import search_templates
from tests.templates.helpers import exhaustive_best, profiles, stage_cost


@pytest.mark.timeout(120)
@settings(max_examples=80, deadline=None)
@given(
    profile=profiles(max_layers=10),
    gpus=st.sampled_from([1, 2, 4]),
    microbatches=st.lists(st.integers(1, 16), min_size=6, max_size=6),
)
def test_templates_equal_exhaustive_search(profile: Profile, gpus: int, microbatches: list[int]) -> None:
    shares = {n: microbatches[n - 1] for n in range(1, 7)}
    found = search_templates(StageCosts(profile, gpus), shares)
    for n, m in shares.items():
        reference = exhaustive_best(profile, gpus, n, m)
        if reference is None:
            assert n not in found, f"{n} stages: search found a layout, exhaustive search found none"
            continue
        template = found[n]
        assert template.iteration_time == pytest.approx(reference, rel=1e-9, abs=1e-12)
        # The layout is what it claims: contiguous, in order, fits memory, times recomputed.
        bounds = template.stages
        assert bounds[0][0] == 0 and bounds[-1][1] == profile.num_layers
        assert all(a < b for a, b in bounds) and all(bounds[i][1] == bounds[i + 1][0] for i in range(n - 1))
        for s, (a, b) in enumerate(bounds):
            time, memory = stage_cost(profile, gpus, a, b, n - s)
            assert memory <= gpus * profile.device.memory_bytes
            assert template.stage_times[s] == pytest.approx(time, rel=1e-9, abs=1e-12)


def _one_best_subplan(profile: Profile, gpus: int, stages: int, microbatches: int) -> float | None:
    """Oobleck-style DP: one locally best sub-layout per (layer suffix, stages). Not exact."""
    n = profile.num_layers
    # best[k][i] = (sum, max) of the kept sub-layout of layers [i, n) in k stages.
    best: dict[tuple[int, int], tuple[float, float]] = {}
    for k in range(1, stages + 1):
        for i in range(n):
            options = []
            ends = [n] if k == 1 else range(i + 1, n)
            for j in ends:
                time, memory = stage_cost(profile, gpus, i, j, k)
                if memory > gpus * profile.device.memory_bytes:
                    continue
                if k == 1:
                    options.append((time, time))
                elif (k - 1, j) in best:
                    s, m = best[(k - 1, j)]
                    options.append((s + time, max(m, time)))
            if options:
                best[(k, i)] = min(options, key=lambda sm: sm[0] + (microbatches - 1) * sm[1])
    if (stages, 0) not in best:
        return None
    s, m = best[(stages, 0)]
    return s + (microbatches - 1) * m


@pytest.mark.timeout(60)
def test_exhaustive_reference_catches_the_one_best_subplan_dp() -> None:
    """The exactness test has teeth: it separates an exact search from Oobleck's local choice."""
    from hypothesis import find

    def differs(args: tuple[Profile, int]) -> bool:
        profile, m = args
        stages = min(4, profile.num_layers)
        greedy = _one_best_subplan(profile, 1, stages, m)
        exact = exhaustive_best(profile, 1, stages, m)
        return greedy is not None and exact is not None and greedy > exact * (1 + 1e-9)

    profile, m = find(
        st.tuples(profiles(min_layers=4, max_layers=8, tight=False), st.integers(2, 8)),
        differs,
        settings=settings(max_examples=2000, database=None),
    )
    stages = min(4, profile.num_layers)
    exact = search_templates(StageCosts(profile, 1), {stages: m})[stages].iteration_time
    assert exact == pytest.approx(exhaustive_best(profile, 1, stages, m), rel=1e-9)
    assert exact < _one_best_subplan(profile, 1, stages, m)  # type: ignore[operator]
