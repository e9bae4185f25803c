"""Template search: exact against exhaustive search; stage layouts well-formed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from templates.cost import StageCosts
from templates.profile import PLANNED_RECOMPUTE, RECOMPUTE_MODES, DeviceProfile, LayerProfile, Profile
from templates.search import search_templates
from tests.templates.helpers import (
    SLOW_OR_FILTERED,
    best_stage,
    capacity,
    exhaustive_best,
    profiles,
    stage_cost,
)


@pytest.mark.timeout(120)
@settings(max_examples=80, deadline=None, suppress_health_check=SLOW_OR_FILTERED)
@given(
    profile=profiles(max_layers=10),
    gpus=st.sampled_from([1, 2, 4]),
    microbatches=st.lists(st.integers(1, 16), min_size=6, max_size=6),
    recompute=st.sampled_from(PLANNED_RECOMPUTE),
)
def test_templates_equal_exhaustive_search(profile: Profile, gpus: int, microbatches: list[int], recompute: str) -> None:
    """Exact for every recomputation setting: one mode forced on every stage, or each stage's
    fastest mode that fits ("auto"), against trying every split and every stage's every mode."""
    shares = {n: microbatches[n - 1] for n in range(1, 7)}
    modes = RECOMPUTE_MODES if recompute == "auto" else (recompute,)
    found = search_templates(StageCosts(profile, gpus, recompute), shares)
    for n, m in shares.items():
        reference = exhaustive_best(profile, gpus, n, m, modes)
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
            time, memory = stage_cost(profile, gpus, a, b, n - s, template.stage_modes[s])
            assert memory <= capacity(profile, gpus)
            assert template.stage_times[s] == pytest.approx(time, rel=1e-9, abs=1e-12)
            best = best_stage(profile, gpus, a, b, n - s, modes)
            assert best is not None and time == pytest.approx(best[0], rel=1e-9, abs=1e-12)

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
                if memory > capacity(profile, gpus):
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
def test_the_one_best_subplan_dp_is_not_exact_but_the_search_is() -> None:
    """The exactness check has teeth: a case (found by hypothesis) where Oobleck's local choice loses."""
    times = [(1.0, 2.0), (1.0, 2.0), (1.0, 2.0), (1.0, 1.0), (1.25, 0.5), (1.0, 3.0)]
    layers = tuple(
        LayerProfile(
            forward=fwd,
            backward=bwd,
            param_bytes=0,
            optimizer_bytes=0,
            activation_bytes=0,
            output_bytes=11 if i == 3 else 0,
        )
        for i, (fwd, bwd) in enumerate(times)
    )
    device = DeviceProfile(
        memory_bytes=10**9, p2p_latency=0.0, p2p_bandwidth=26.0, allreduce_latency=0.0, allreduce_bandwidth=10.0
    )
    profile = Profile(model="counterexample", microbatch_size=1, layers=layers, device=device)
    exact = search_templates(StageCosts(profile, 1), {3: 2})[3].iteration_time
    assert exact == pytest.approx(exhaustive_best(profile, 1, 3, 2)) == pytest.approx(23.5)
    greedy = _one_best_subplan(profile, 1, 3, 2)
    assert greedy is not None and greedy > exact + 0.05
