"""The simulator's last-copy watch (elastic/sim/copies.py, issue 55) against brute force over
the real ownership (templates/optim_slices.py): losses within a window, none across windows,
and exposure = the live nodes whose one more failure would lose a copy, times the window."""

from __future__ import annotations

import random

import pytest

from elastic.sim.copies import CopyWatch
from elastic.sim.report import format_table
from elastic.sim.simulate import simulate
from elastic.sim.trace import Trace, TraceEvent
from templates.optim_slices import layer_holders, lost_slices, plan_owners
from templates.plan import Plan, even_plan


def _plan(pipelines: int, stages: int, f: int = 1, virtual: int = 1) -> Plan:
    return even_plan(num_layers=8, nodes=list(range(pipelines * stages)), num_pipelines=pipelines,
                     global_microbatches=4 * pipelines, microbatch_size=1, fault_tolerance=f, virtual_stages=virtual)


def _lost_layers(plan: Plan, lost: set[int]) -> int:
    return sum(set(layer_holders(plan, layer)) <= lost for layer in range(plan.num_layers))


def _exposed(plan: Plan, lost: set[int]) -> tuple[int, int]:
    """(live nodes whose failure would lose one more layer, ... one more slice), by trying each."""
    owned = plan_owners(plan)
    live = [n for n in plan.nodes if n not in lost]
    return (sum(_lost_layers(plan, lost | {n}) > _lost_layers(plan, lost) for n in live),
            sum(len(lost_slices(owned, lost | {n})) > len(lost_slices(owned, lost)) for n in live))


@pytest.mark.parametrize(("pipelines", "stages", "virtual"), [(4, 2, 1), (2, 2, 1), (6, 1, 1), (4, 2, 2), (8, 2, 1)])
@pytest.mark.parametrize("seed", range(6))
def test_losses_and_exposure_equal_brute_force(pipelines: int, stages: int, virtual: int, seed: int) -> None:
    rng = random.Random(seed)
    plan = _plan(pipelines, stages, virtual=virtual)
    owned = plan_owners(plan)
    watch = CopyWatch()
    t, window_lost, layers, slices, layer_s, slice_s = 0.0, set[int](), 0, 0, 0.0, 0.0
    down: set[int] = set()
    for _ in range(rng.randint(1, 4)):
        t += rng.choice([1.0, 30.0])  # within the last window (10 s) or after it
        node = rng.choice([n for n in plan.nodes if n not in down])
        if t >= watch.until:
            window_lost, down = set(), set()  # a new window: what failed before was re-protected
        window_lost.add(node)
        down.add(node)
        layers += _lost_layers(plan, window_lost) > 0
        slices += bool(lost_slices(owned, window_lost))
        exposed = _exposed(plan, window_lost)
        watch.failure(plan, node, t)
        watch.protected(t + 10.0)
        layer_s, slice_s = layer_s + exposed[0] * 10.0, slice_s + exposed[1] * 10.0
    c = watch.counts
    assert (c.layers_lost, c.slices_lost) == (layers, slices)
    assert (c.layer_exposure_node_s, c.slice_exposure_node_s) == (layer_s, slice_s)


def test_a_second_failure_of_the_other_owner_loses_the_slice_not_the_layer() -> None:
    plan = _plan(4, 1)
    owned = plan_owners(plan)
    a, b = owned[0].owners[0]
    other = owned[0].owners[1][0]
    for second, lost in ((b, 1), (other, 0)):
        watch = CopyWatch()
        watch.failure(plan, a, 0.0)
        watch.protected(10.0)
        watch.failure(plan, second, 5.0)
        assert (watch.counts.layers_lost, watch.counts.slices_lost) == (0, lost)
    watch = CopyWatch()
    watch.failure(plan, a, 0.0)
    watch.protected(10.0)
    watch.failure(plan, b, 10.0)  # the copies were back: a new window
    assert watch.counts.slices_lost == 0


def test_simulate_reports_the_trade() -> None:
    from elastic.planning.cluster import ClusterSpec
    from elastic.sim.config import RecoveryCosts

    cluster = ClusterSpec(model="gpt3-350m", nodes=8, fault_tolerance=1, global_batch=32, microbatch=1,
                          device_memory_gib=16.0)
    trace = Trace(initial_nodes=8, events=(TraceEvent(time_s=100.0, event="fail", node=2),
                                           TraceEvent(time_s=100.5, event="fail", node=5)))
    report = simulate(cluster, RecoveryCosts(), trace, horizon_s=600.0)
    (elastic,) = [p for p in report["policies"] if p["policy"] == "elastic"]
    assert set(elastic["copies"]) == {"layers_lost", "slices_lost", "layer_exposure_node_s", "slice_exposure_node_s"}
    assert elastic["copies"]["slice_exposure_node_s"] > 0
    assert all("copies" not in p for p in report["policies"] if p["policy"] != "elastic")
    (line,) = [ln for ln in format_table(report).splitlines() if ln.startswith("last copies (elastic)")]
    assert f"optimizer slice {elastic['copies']['slices_lost']} time(s)" in line
