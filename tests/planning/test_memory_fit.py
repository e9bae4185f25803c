"""The planner's plans fit the device by the memory model, also where the batch splits unevenly.

The templates' memory check counts the gradient sums of even batch splits (planner_figures.py):
a plan that splits its batch unevenly between pipelines of different depths can leave a worker
over the device. `choose_plan` checks its plan worker by worker with the memory model
(`plan_memory`, which the tensor walk of a real Trainer equals: tests/engine/test_memory_model.py)
and plans again with the excess held back on every worker (`ClusterSpec.memory_margin_bytes`).
Checked here against `plan_memory` computed afresh, and against the plans made without the check
(`choose_optimizer`), over a grid of tiny clusters at tight memory.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from elastic.planning.cluster import ClusterSpec, cluster_templates, replan_templates
from elastic.planning.memory import plan_memory
from elastic.planning.optimizer_choice import choose_optimizer, choose_plan
from templates.plan import Plan
from templates.template_set import PlanningError

pytestmark = pytest.mark.timeout(300)

UNEVEN = ClusterSpec(model="tiny", nodes=5, fault_tolerance=1, global_batch=8, microbatch=1, device_memory_gib=0.034)
"""Without the check: pipelines of 3 and 2 nodes take 3 and 5 of the 8 microbatches; the second's
share of the summation tree is 2 blocks (the even split's, which the figures bound, 1), and its
last stage exceeds the device."""


def _largest(spec: ClusterSpec, plan: Plan, sharded: bool) -> int:
    return plan_memory(spec.config, plan, device_type=spec.device_type, sharded_optimizer=sharded).estimate.total


def _device(spec: ClusterSpec) -> int:
    return int(spec.device_memory_gib * 2**30)


def test_an_uneven_split_over_the_device_is_planned_again_until_it_fits() -> None:
    unchecked = choose_optimizer(UNEVEN, "off")
    assert sorted(p.microbatches for p in unchecked.plan.pipelines) == [3, 5]
    assert _largest(UNEVEN, unchecked.plan, False) > _device(UNEVEN)
    chosen = choose_plan(UNEVEN, "off")
    assert chosen.fits and chosen.margin_bytes > 0 and chosen.plan != unchecked.plan
    assert _largest(UNEVEN, chosen.plan, False) <= _device(UNEVEN)
    assert chosen.memory is not None and chosen.memory.estimate.total == _largest(UNEVEN, chosen.plan, False)
    # The margin is what the templates held back: the same spec with it plans the same.
    again = choose_optimizer(dataclasses.replace(UNEVEN, memory_margin_bytes=chosen.margin_bytes), "off")
    assert again.plan == chosen.plan


def test_every_tiny_plan_fits_or_no_plan_with_a_margin_exists() -> None:
    """2 to 8 nodes, f = 0 and 1, three batch shapes, sharded and not, memory from 14 to 42 MiB:
    a plan that fits without the check is kept as it is; one that does not is replaced by one
    that fits, or, where none does, kept and said (`fits` False, no margin)."""
    replaced = unfit = 0
    grid = itertools.product(range(2, 9), (0, 1), ((1, 8), (2, 8), (1, 16)), ("off", "on"),
                             [0.014 + 0.004 * i for i in range(8)])
    for nodes, f, (mb, gb), mode, gib in grid:
        spec = ClusterSpec(model="tiny", nodes=nodes, fault_tolerance=f, global_batch=gb, microbatch=mb,
                           device_memory_gib=gib)
        try:
            unchecked = choose_optimizer(spec, mode)
        except PlanningError:
            continue
        chosen = choose_plan(spec, mode)
        case = (nodes, f, mb, gb, mode, gib)
        largest = _largest(spec, chosen.plan, chosen.sharded)
        assert chosen.memory is not None and chosen.memory.estimate.total == largest, case
        if _largest(spec, unchecked.plan, unchecked.sharded) <= _device(spec):
            assert chosen.plan == unchecked.plan and chosen.margin_bytes == 0, case
        elif chosen.fits:
            assert largest <= _device(spec) and chosen.margin_bytes > 0, case
            replaced += 1
        else:
            assert chosen.plan == unchecked.plan and chosen.margin_bytes == 0 and largest > _device(spec), case
            unfit += 1
    print(f"{replaced} plans replaced, {unfit} kept over the device")
    assert replaced >= 5, "the grid no longer holds plans that an uneven split puts over the device"
    assert unfit <= replaced // 5, (unfit, replaced)


def test_the_margin_reaches_the_templates_and_the_leaders_replans() -> None:
    margin = 3 << 20
    spec = dataclasses.replace(UNEVEN, memory_margin_bytes=margin)
    plain = cluster_templates(UNEVEN).profile.memory.worker_bytes
    assert cluster_templates(spec).profile.memory.worker_bytes == plain + margin
    assert replan_templates(spec).profile.memory.worker_bytes == plain + margin
    with pytest.raises(ValueError, match="memory margin must be >= 0"):
        dataclasses.replace(UNEVEN, memory_margin_bytes=-1)
