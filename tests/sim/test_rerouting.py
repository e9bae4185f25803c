"""The ReCycle step over a few changed slots (`Rerouting`, what the recycle policy runs at each
event) against the step over the whole slot table (`rerouted_step_s`): the same seconds, or the
same stall, for random holes and slow nodes."""

from __future__ import annotations

import random

import pytest

from elastic.sim.reroute import Rerouting, rerouted_step_s


@pytest.mark.parametrize("seed", range(8))
def test_the_changed_slots_give_the_whole_tables_step(seed: int) -> None:
    rng = random.Random(seed)
    stalls = steps = 0
    for _ in range(300):
        pipelines, depth = rng.randint(1, 12), rng.randint(1, 4)
        stage = [rng.choice([0.1, 0.25, 0.3, 1.0]) for _ in range(depth)]
        base = [[t * rng.choice([1.0, 1.0, 1.5]) for t in stage] for _ in range(pipelines)]
        microbatches = [rng.randint(1, 5) for _ in range(pipelines)]
        places = [(p, s) for p in range(pipelines) for s in range(depth)]
        changed: dict[tuple[int, int], float | None] = {}
        for place in rng.sample(places, rng.randint(0, min(len(places), 6))):
            changed[place] = None if rng.random() < 0.6 else base[place[0]][place[1]] * rng.choice([1.0, 1.5, 3.0])
        times = [[changed.get((p, s), base[p][s]) for s in range(depth)] for p in range(pipelines)]
        hidden = rng.choice([0.0, 0.5, 1.0])
        expected = rerouted_step_s(base, times, microbatches, hidden=hidden)
        assert Rerouting(base, microbatches).step_s(changed, hidden=hidden) == expected
        stalls, steps = stalls + (expected is None), steps + (expected is not None)
    assert stalls and steps  # both outcomes seen
