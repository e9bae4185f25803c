"""Optimizer-state slice ownership (templates/optim_slices.py, issue 55), against brute force:
every set of lost nodes is tried, and every move list is replayed on element-tagged arrays."""

from __future__ import annotations

import itertools
import random

import pytest

from templates.optim_slices import (
    ALIGN,
    SliceLost,
    SliceOwnership,
    aligned_cuts,
    layer_holders,
    layer_owners,
    lost_slices,
    plan_owners,
    plan_slice_moves,
    slice_bounds,
    slice_count,
    slice_moves,
)
from templates.plan import Plan, even_plan

SIZES = (768, 1001, 3, 192, 4096)
"""A layer's parameters' sizes: cuts fall inside parameters and on 64-element grids of their own."""


def _plan(pipelines: int, stages: int, f: int, nodes: list[int] | None = None) -> Plan:
    nodes = nodes if nodes is not None else list(range(pipelines * stages))
    return even_plan(num_layers=6, nodes=nodes, num_pipelines=pipelines, global_microbatches=2 * pipelines,
                     microbatch_size=1, fault_tolerance=f)


CASES = [(p, s, f) for p in range(1, 9) for s in (1, 2) for f in range(0, 4) if f < p]


@pytest.mark.parametrize(("pipelines", "stages", "f"), CASES)
def test_every_holder_owns_one_slice_and_each_slice_has_f_plus_1_owners(pipelines: int, stages: int, f: int) -> None:
    plan = _plan(pipelines, stages, f)
    for layer, own in plan_owners(plan).items():
        holders = layer_holders(plan, layer)
        assert own.slices == max(1, pipelines // (f + 1))
        assert sorted(n for nodes in own.owners for n in nodes) == sorted(holders)  # each exactly once
        assert min(len(nodes) for nodes in own.owners) >= f + 1
        assert max(len(nodes) for nodes in own.owners) - min(len(nodes) for nodes in own.owners) <= 1


@pytest.mark.parametrize(("pipelines", "stages", "f"), [c for c in CASES if c[0] <= 6])
def test_lost_slices_equals_brute_force_and_no_f_losses_lose_a_slice(pipelines: int, stages: int, f: int) -> None:
    plan = _plan(pipelines, stages, f)
    owned = plan_owners(plan)
    for k in range(0, f + 2):
        for lost in itertools.combinations(plan.nodes, k):
            got = {(e.layer, e.index) for e in lost_slices(owned, lost)}
            want = {(layer, j) for layer, own in owned.items()
                    for j, nodes in enumerate(own.owners) if all(n in lost for n in nodes)}
            assert got == want
            if k <= f:
                assert not got, (lost, owned)
    if pipelines >= 2 * (f + 1):  # sharded: f + 1 nodes can take every copy of one slice
        own = owned[0]
        assert lost_slices(owned, own.owners[0])


def test_a_lost_slice_is_named() -> None:
    plan = _plan(4, 1, 1)
    owned = plan_owners(plan)
    (err,) = [e for e in lost_slices(owned, owned[3].owners[1]) if e.layer == 3]  # one-stage: every layer
    assert str(err) == f"layer 3, optimizer slice 2 of 2: every owner lost (nodes {owned[3].owners[1][0]}, " \
                       f"{owned[3].owners[1][1]})"


@pytest.mark.parametrize("seed", range(30))
def test_owners_of_a_slice_are_in_different_domains_where_the_holders_allow(seed: int) -> None:
    rng = random.Random(seed)
    pipelines = rng.randint(2, 8)
    f = rng.randint(0, min(2, pipelines - 1))
    plan = _plan(pipelines, 1, f)
    slices = slice_count(pipelines, f)
    hosts = rng.randint(2, pipelines)
    domains = {n: f"host{rng.randrange(hosts)}" for n in plan.nodes}
    crowded = max(list(domains.values()).count(d) for d in set(domains.values()))
    owned = plan_owners(plan, domains=domains)
    for own in owned.values():
        for nodes in own.owners:
            in_one = max(sum(domains[n] == domains[m] for m in nodes) for n in nodes)
            # a domain of c holders must put ceil(c / S) of them on one slice: no more than that
            assert in_one <= -(-crowded // slices), (domains, own)


def _replay(old: SliceOwnership, new: SliceOwnership, live: list[int]) -> int:
    """Apply `slice_moves` to element-tagged arrays; every new owner must end with exactly its
    slice. The elements moved."""
    have = {n: dict.fromkeys(range(*old.bounds(j, SIZES)), True)
            for j, nodes in enumerate(old.owners) for n in nodes if n in live}
    moved = 0
    for m in slice_moves(old, new, sizes=SIZES, live=live):
        assert all(e in have[m.source] for e in range(m.start, m.stop)), m
        have.setdefault(m.node, {}).update(dict.fromkeys(range(m.start, m.stop), True))
        moved += m.stop - m.start
    for j, nodes in enumerate(new.owners):
        for n in nodes:
            assert set(range(*new.bounds(j, SIZES))) <= set(have.get(n, {})), (n, j)
    return moved


@pytest.mark.parametrize(("pipelines", "f", "lost"), [(4, 1, 1), (4, 1, 2), (6, 1, 1), (8, 1, 3), (8, 3, 2),
                                                      (5, 1, 1), (3, 0, 1), (7, 2, 2)])
def test_a_replan_moves_only_what_new_owners_lack_and_less_than_a_fresh_assignment(
        pipelines: int, f: int, lost: int) -> None:
    plan = _plan(pipelines, 1, f)
    rng = random.Random(pipelines * 100 + f * 10 + lost)
    before = plan_owners(plan)
    while True:  # a loss that leaves every slice an owner (the other kind: test_moves_need_a_live_old_owner)
        survivors = [n for n in plan.nodes if n not in rng.sample(list(plan.nodes), lost)]
        if not lost_slices(before, set(plan.nodes) - set(survivors)):
            break
    after_plan = _plan(len(survivors), 1, min(f, len(survivors) - 1), nodes=survivors)
    kept, fresh = plan_owners(after_plan, previous=before), plan_owners(after_plan)
    for layer in range(plan.num_layers):
        moved = _replay(before[layer], kept[layer], survivors)
        assert moved <= _replay(before[layer], fresh[layer], survivors)
        if kept[layer].slices == before[layer].slices:  # same cut: only a survivor changing slice moves
            own = kept[layer]
            sizes = [own.bounds(j, SIZES)[1] - own.bounds(j, SIZES)[0] for j in range(own.slices)]
            assert moved == sum(sizes[j] for j, nodes in enumerate(own.owners)
                                for n in nodes if before[layer].slice_of(n) != j)


def test_moves_need_a_live_old_owner() -> None:
    plan = _plan(4, 1, 1)
    before = plan_owners(plan)
    gone = before[0].owners[0]
    survivors = [n for n in plan.nodes if n not in gone]
    after = plan_owners(_plan(2, 1, 1, nodes=survivors), previous=before)
    with pytest.raises(SliceLost, match="layer 0, optimizer slice 1 of 2"):
        slice_moves(before[0], after[0], sizes=SIZES, live=survivors)


def test_slice_bounds_tile_the_layer() -> None:
    for slices in range(1, 9):
        bounds = [slice_bounds(1001, slices, j) for j in range(slices)]
        assert bounds[0][0] == 0 and bounds[-1][1] == 1001
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    with pytest.raises(ValueError):
        slice_count(0, 1)


def test_plan_owners_equals_each_layer_asked_alone() -> None:
    """plan_owners computes once per distinct holder set: the same as asking layer by layer."""
    plan, later = _plan(6, 2, 1), _plan(5, 2, 1, nodes=[0, 1, 2, 3, 4, 5, 6, 7, 10, 11])
    before = plan_owners(plan, domains={n: f"host{n % 3}" for n in plan.nodes})
    for p, prev in ((plan, None), (later, before)):
        got = plan_owners(p, domains={n: f"host{n % 3}" for n in p.nodes}, previous=prev)
        assert got == {layer: layer_owners(p, layer, domains={n: f"host{n % 3}" for n in p.nodes},
                                           previous=None if prev is None else prev[layer])
                       for layer in range(p.num_layers)}


@pytest.mark.parametrize("pipelines", range(1, 13))
def test_the_round_robin_shortcut_is_the_greedy_fill(pipelines: int) -> None:
    """Holders each in a domain of their own and nothing to keep: layer_owners' round robin
    gives what the general greedy fill gives."""
    from templates.optim_slices import _Filler

    for f in range(min(pipelines, 4)):
        plan = _plan(pipelines, 1, f)
        holders = layer_holders(plan, 0)
        fill = _Filler(holders=len(holders), slices=slice_count(len(holders), f))
        for n in holders:
            fill.add(n, f"d{n}", {})
        assert layer_owners(plan, 0).owners == tuple(tuple(sorted(o)) for o in fill.owners)


@pytest.mark.parametrize("sizes", [SIZES, (5,), (64, 64), (1, 1, 1, 1), (130, 7, 500), ()])
def test_aligned_cuts_sit_on_each_parameters_grid_next_to_the_even_split(sizes: tuple[int, ...]) -> None:
    starts = list(itertools.accumulate(sizes, initial=0))
    numel = starts[-1]
    for slices in range(1, 10):
        cuts = aligned_cuts(sizes, slices)
        assert len(cuts) == slices + 1 and cuts[0] == 0 and cuts[-1] == numel
        assert all(a <= b for a, b in itertools.pairwise(cuts))
        for j, c in enumerate(cuts[1:-1], start=1):
            param = max(i for i in range(len(sizes)) if starts[i] <= c) if sizes else 0
            assert (c - starts[param]) % ALIGN == 0 or c == numel
            even = j * numel // slices
            assert c <= even and (even - c < ALIGN or c == cuts[j - 1])


@pytest.mark.parametrize(("pipelines", "stages", "f", "seed"),
                         [(4, 1, 1, 0), (4, 2, 1, 1), (6, 2, 1, 2), (8, 1, 1, 3), (8, 2, 3, 4), (6, 1, 2, 5)])
def test_a_generation_change_gives_every_new_owner_its_slice_from_live_old_owners(
        pipelines: int, stages: int, f: int, seed: int) -> None:
    rng = random.Random(seed)
    plan = _plan(pipelines, stages, f)
    before = plan_owners(plan)
    sizes = {layer: SIZES for layer in range(plan.num_layers)}
    while True:
        lost = set(rng.sample(list(plan.nodes), stages * rng.randint(1, max(1, f))))
        if not lost_slices(before, lost):
            break
    survivors = [n for n in plan.nodes if n not in lost]
    new_plan = _plan(len(survivors) // stages, stages, min(f, len(survivors) // stages - 1), nodes=survivors)
    after, moves = plan_slice_moves(plan, new_plan, lost=lost, sizes=sizes)
    assert after == plan_owners(new_plan, previous=before)
    for layer in range(plan.num_layers):
        have = {n: set(range(*before[layer].bounds(j, SIZES)))
                for j, nodes in enumerate(before[layer].owners) for n in nodes if n not in lost}
        for m in (m for m in moves if m.layer == layer):
            assert m.source not in lost and set(range(m.start, m.stop)) <= have[m.source], m
            have.setdefault(m.node, set()).update(range(m.start, m.stop))
        for j, nodes in enumerate(after[layer].owners):
            for n in nodes:
                assert set(range(*after[layer].bounds(j, SIZES))) <= have.get(n, set()), (layer, n, j)


def test_a_generation_change_that_lost_every_owner_of_a_slice_names_it() -> None:
    plan = _plan(4, 1, 1)
    before = plan_owners(plan)
    lost = set(before[0].owners[1])
    survivors = [n for n in plan.nodes if n not in lost]
    with pytest.raises(SliceLost, match=r"^layer 0, optimizer slice 2 of 2: every owner lost \(nodes "):
        plan_slice_moves(plan, _plan(2, 1, 1, nodes=survivors), lost=lost,
                         sizes={layer: SIZES for layer in range(plan.num_layers)})


def test_moves_spread_over_the_live_owners() -> None:
    """Eight one-stage pipelines lose one node: where an old slice has several live owners and
    new owners need parts of it in several layers, more than one of them sends."""
    plan = _plan(8, 1, 3)
    before = plan_owners(plan)
    lost = {before[0].owners[0][0]}
    survivors = [n for n in plan.nodes if n not in lost]
    _, moves = plan_slice_moves(plan, _plan(7, 1, 1, nodes=survivors), lost=lost,
                                sizes={layer: SIZES for layer in range(plan.num_layers)})
    by_slice: dict[int, set[int]] = {}  # one-stage pipelines: every layer has the same owners
    for m in moves:
        old = before[m.layer]
        i = next(i for i in range(old.slices) if old.bounds(i, SIZES)[0] <= m.start < old.bounds(i, SIZES)[1])
        by_slice.setdefault(i, set()).add(m.source)
    assert any(len(sources) > 1 for sources in by_slice.values()), by_slice
