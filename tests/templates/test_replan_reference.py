"""Re-planning against the plain procedure it speeds up: build every candidate's whole plan,
order every group and price every node, then pick. The same plan, fetch bytes and strategy,
event after event, including plans laid out by other templates than the re-planner's."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from templates.instantiation import build_plan, choose_sizes, instantiate
from templates.plan import Plan
from templates.profile import DeviceProfile, LayerProfile, Profile
from templates.replanning import Replan, _fastest_groups, _keep_groups, replan
from templates.template_set import PlanningError, TemplateSet, build_templates
from tests.templates.helpers import SLOW_OR_FILTERED, profiles


def reference_replan(tset: TemplateSet, current: Plan, nodes: list[int], *, tolerance: float = 0.05) -> Replan:
    """The re-planner as first written (templates/replanning.py's module doc), step by step."""
    mbs, f = current.global_microbatches, current.fault_tolerance
    live = sorted(nodes)
    held = {st.node: st.ranges for pipe in current.pipelines for st in pipe.stages}
    for layer in range(current.num_layers):
        holders = [st.node for pipe in current.pipelines for st in pipe.stages if st.holds(layer)]
        if not set(holders) & set(live):
            raise PlanningError(f"layer {layer} has no surviving holder")
    sizes = choose_sizes(tset, len(live), global_microbatches=mbs, fault_tolerance=f)
    survivors = [g for g in ([st.node for st in pipe.stages if st.node in live] for pipe in current.pipelines) if g]
    gained = sorted(set(live) - set(held))
    prefix = np.concatenate([[0], np.cumsum([tset.profile.layer_bytes(i) for i in range(tset.num_layers)])])

    def fetch(node: int, ranges: tuple[tuple[int, int], ...]) -> int:
        mine = {layer for a, b in held.get(node, ()) for layer in range(a, b)}
        return sum(int(prefix[i + 1] - prefix[i]) for a, b in ranges for i in range(a, b) if i not in mine)

    def order(group: list[int]) -> list[int]:
        template = tset.template(len(group))
        stages = template.chunks or tuple((rng,) for rng in template.stages)
        old = sorted((n for n in group if n in held), key=lambda n: (held[n][0], n))
        new = sorted(n for n in group if n not in held)
        options = [old[:i] + new + old[i:] for i in range(len(old) + 1)] if new else [old]
        return min(options, key=lambda o: sum(fetch(n, r) for n, r in zip(o, stages, strict=True)))

    options = [o for o in (_keep_groups(tset, survivors, gained), ("fastest", _fastest_groups(sizes, survivors, gained)))
               if o is not None]
    built = []
    for rank, (label, groups) in enumerate(options):
        if f + 1 <= len(groups) <= mbs:
            plan = build_plan(tset, [order(g) for g in groups], global_microbatches=mbs, fault_tolerance=f)
            cost = {st.node: fetch(st.node, st.ranges) for pipe in plan.pipelines for st in pipe.stages}
            built.append((plan, cost, label, rank))
    best = min(plan.iteration_time for plan, _, _, _ in built)
    eligible = [b for b in built if b[0].iteration_time <= best * (1 + tolerance)]
    plan, cost, label, _ = min(eligible, key=lambda b: (sum(b[1].values()), b[0].iteration_time, b[3]))
    return Replan(plan=plan, fetch_bytes=cost, strategy=label, gpus_per_node=tset.gpus_per_node)


def same_outcome(tset: TemplateSet, current: Plan, live: list[int]) -> Replan | None:
    """replan's answer, checked against the reference's (None: both refuse)."""
    try:
        expected = reference_replan(tset, current, live)
    except PlanningError:
        with pytest.raises(PlanningError):
            replan(tset, current, live)
        return None
    got = replan(tset, current, live)
    assert got.plan == expected.plan
    assert list(got.fetch_bytes.items()) == list(expected.fetch_bytes.items())
    assert got.strategy == expected.strategy
    return got


def uniform_profile(layers: int) -> Profile:
    """Equal layers of which a node holds at most 4: n0 = layers / 4."""
    layer = LayerProfile(forward=1.0, backward=2.0, param_bytes=100, optimizer_bytes=200, activation_bytes=10,
                         output_bytes=5)
    device = DeviceProfile(memory_bytes=4 * 400, p2p_latency=0.01, p2p_bandwidth=100.0, allreduce_latency=0.0,
                           allreduce_bandwidth=1.0)
    return Profile(model="uniform", microbatch_size=1, layers=(layer,) * layers, device=device)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("seed", "microbatches", "virtual"), [(0, 64, 1), (1, 12, 1), (2, 40, 0), (3, 9, 0)])
def test_event_after_event_the_same_as_the_reference(seed: int, microbatches: int, virtual: int) -> None:
    """Nodes fail and come back (and new ones join) over a plan of 40 nodes; each re-plan starts
    from the one before, as the leader's do."""
    rng = random.Random(seed)
    tset = build_templates(uniform_profile(16), gpus_per_node=2, num_nodes=40, fault_tolerance=1,
                           global_microbatches=microbatches, virtual_stages=virtual)
    plan = instantiate(tset, list(range(40)), global_microbatches=microbatches, fault_tolerance=1)
    down: list[int] = []
    fresh = 100
    for _ in range(25):
        roll = rng.random()
        if roll < 0.5 and len(plan.nodes) > 30:
            down.append(rng.choice(plan.nodes))
            live = [n for n in plan.nodes if n != down[-1]]
        elif roll < 0.8 and down:
            live = [*plan.nodes, down.pop(rng.randrange(len(down)))]
        else:
            live, fresh = [*plan.nodes, fresh], fresh + 1
        found = same_outcome(tset, plan, live)
        if found is not None:
            plan = found.plan


@pytest.mark.timeout(120)
def test_a_plan_of_other_templates_is_relaid_like_the_reference() -> None:
    """A current plan laid out by 1F1B templates, re-planned with interleaved ones: no group is
    taken as unchanged unless its layout is the template's."""
    plain = build_templates(uniform_profile(16), gpus_per_node=2, num_nodes=24, fault_tolerance=1,
                            global_microbatches=48, virtual_stages=1)
    mixed = build_templates(uniform_profile(16), gpus_per_node=2, num_nodes=24, fault_tolerance=1,
                            global_microbatches=48, virtual_stages=0)
    assert any(t.virtual_stages > 1 for t in mixed.templates.values())
    plan = instantiate(plain, list(range(24)), global_microbatches=48, fault_tolerance=1)
    for lost in (0, 5, 23):
        same_outcome(mixed, plan, [n for n in range(24) if n != lost])
    same_outcome(mixed, plan, [*range(24), 30])


@pytest.mark.timeout(120)
@settings(max_examples=40, deadline=None, suppress_health_check=SLOW_OR_FILTERED)
@given(profile=profiles(min_layers=6, max_layers=12), total=st.integers(3, 12), f=st.integers(0, 2),
       share=st.sampled_from([0.5, 1.0, 2.0]), data=st.data())
def test_random_changes_the_same_as_the_reference(
    profile: Profile, total: int, f: int, share: float, data: st.DataObject
) -> None:
    microbatches = max(f + 1, round(share * total))
    try:
        tset = build_templates(profile, gpus_per_node=1, num_nodes=total, fault_tolerance=f,
                               global_microbatches=microbatches, virtual_stages=data.draw(st.sampled_from([0, 1])))
        plan = instantiate(tset, list(range(total)), global_microbatches=microbatches, fault_tolerance=f)
    except PlanningError:
        assume(False)
        return
    lost = data.draw(st.sets(st.sampled_from(range(total)), max_size=max(1, f)))
    joined = data.draw(st.sets(st.integers(total, total + 4), max_size=3))
    assume(lost or joined)
    same_outcome(tset, plan, [*(n for n in range(total) if n not in lost), *sorted(joined)])
