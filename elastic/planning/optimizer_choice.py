"""Whether a run's optimizer is sharded, and the plan that goes with it (issue 55).

`choose_plan` compares the fastest plan whose holders keep whole AdamW moments with the fastest
whose holders keep 1/S of them (`sharded_plan`: the templates count 1/S, and the plan has the
S (f + 1) pipelines that make it so). The run records the S its plan counted
(`ClusterSpec.moment_slices`): the leader's re-plans keep it where the live nodes allow
(`cluster.replan_templates`). A model that fits only sharded is planned sharded.

The chosen plan is then checked worker by worker by the memory model (`memory.plan_memory`, equal
to a real Trainer's bytes). The templates' check bounds the gradient sums of even batch splits;
a plan that splits its batch unevenly between pipelines of different depths can leave a worker
over the device, and is planned again with the excess held back on every worker
(`ClusterSpec.memory_margin_bytes`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from elastic.planning.cluster import ClusterSpec, cluster_templates, initial_plan
from elastic.planning.memory import PlanMemory, plan_memory
from templates.optim_slices import slice_count
from templates.plan import Plan
from templates.template_set import PlanningError, TemplateSet


@dataclass(frozen=True, kw_only=True)
class ChosenPlan:
    """The plan of a run and whether its optimizer is sharded (`choose_plan`)."""

    tset: TemplateSet
    plan: Plan
    sharded: bool
    unsharded_time: float | None
    """The unsharded plan's estimated iteration time (the comparison `auto` made); None: no
    plan fits with whole moments."""
    gather_time: float = 0.0
    """The sharded plan's parameter gather a step (`gather_time`): counted on top of its
    iteration time when `auto` compares; 0 unsharded."""
    memory: PlanMemory | None = None
    """The plan's largest worker by the memory model (`choose_plan` sets it)."""
    margin_bytes: int = 0
    """Bytes the templates held back on every worker to make the plan fit (`memory_margin_bytes`;
    0: the first plan fitted)."""

    @property
    def excess_bytes(self) -> int:
        """Bytes the largest worker needs beyond the device by the memory model (<= 0: it fits)."""
        assert self.memory is not None
        return self.memory.estimate.total - self.tset.profile.device.memory_bytes

    @property
    def fits(self) -> bool:
        """Whether the largest worker fits the device by the memory model."""
        return self.excess_bytes <= 0

    @property
    def slices(self) -> int:
        """S: slices of every layer's moments (1 unsharded)."""
        return plan_slices(self.plan) if self.sharded else 1

    @property
    def counted_slices(self) -> int:
        """The S the templates counted (at most `slices`): the floor the leader's re-plans keep
        where they can (`ClusterSpec.moment_slices`)."""
        return self.tset.moment_slices


def plan_slices(plan: Plan) -> int:
    """S of `plan` sharded: its P holders of every layer over f + 1 (`optim_slices.slice_count`)."""
    return slice_count(len(plan.pipelines), plan.fault_tolerance)


def slice_candidates(most: int) -> list[int]:
    """The slice counts `sharded_plan` tries: 1, 2, 3, then powers of two and their 1.5x up to
    `most` (about 2 log2 of it)."""
    out, k = {1, 2, 3}, 4
    while k <= most:
        out |= {k, k * 3 // 2}
        k *= 2
    return sorted(n for n in out if n <= max(1, most))


def sharded_plan(spec: ClusterSpec, unsharded: tuple[TemplateSet, Plan] | None) -> tuple[TemplateSet, Plan] | None:
    """The fastest plan whose holders keep 1/S of the moments. For each candidate S > 1
    (`slice_candidates`) the templates count 1/S of the moments, and their plans have at least
    S (f + 1) pipelines (`TemplateSet.pipelines_needed`), so P // (f + 1) >= S. `unsharded`: the
    plan at S = 1 (None: none fits); ties go to the fewer slices. None if no S has a plan."""
    best = unsharded
    for slices in slice_candidates(spec.nodes // (spec.fault_tolerance + 1))[1:]:
        try:
            tset = cluster_templates(spec, moment_slices=slices)
            plan = initial_plan(spec, tset)
        except PlanningError:
            continue
        if plan_slices(plan) >= slices and (best is None or plan.iteration_time < best[1].iteration_time * (1 - 1e-9)):
            best = (tset, plan)
    return best


def gather_time(tset: TemplateSet, plan: Plan) -> float:
    """Seconds a step of `plan`, sharded, waits for its parameter gather. Each node receives the
    (S - 1) / S of each of its layers' parameters it does not own (S = P // (f + 1)) over its
    link, layer after layer in forward order (posted together: one latency, then the bytes in
    order), and a layer's first forward waits for its share
    (elastic/engine/param_gather.py): the wait is what the transfers take beyond the first
    microbatch's forward of the layers before them, on the slowest stage (each stage timed as if
    its first forward began with the step, which a later stage's does not)."""
    slices = plan_slices(plan)
    if slices < 2:
        return 0.0
    layers, device = tset.profile.layers, tset.profile.device
    worst = 0.0
    for pipe in plan.pipelines:
        for st in pipe.stages:
            sent = ready = computed = 0.0  # bytes the gather brought, the first forward's progress, its compute alone
            for a, b in st.ranges:
                for i in range(a, b):
                    sent += layers[i].param_bytes * (slices - 1) / slices
                    ready = max(ready, device.p2p_time(sent)) + layers[i].forward  # the groups stream back to back
                    computed += layers[i].forward
            worst = max(worst, ready - computed)
    return worst


MEMORY_TRIES = 6
"""Plans `choose_plan` makes again, each holding back the last one's excess on top of its margin."""


def choose_plan(spec: ClusterSpec, shard_optimizer: str) -> ChosenPlan:
    """`choose_optimizer`'s plan, checked by the memory model (`plan_memory`). Where a worker
    exceeds the device (an uneven batch split: the templates' figures bound even ones), the plan
    is made again with the excess held back on every worker, and again with the new plan's excess
    on top, up to MEMORY_TRIES times (a stage's template may have kept more slack than the excess:
    the plan changes only once the margin passes the whole gap between the figures and the exact
    bytes, 4 times the first excess in one of the tiny plans of tests/planning/test_memory_fit.py);
    where no plan fits that way the first stands, and its `fits` is False (`elastic plan` warns)."""
    first = _with_memory(spec, choose_optimizer(spec, shard_optimizer), spec.memory_margin_bytes)
    chosen = first
    for _ in range(MEMORY_TRIES):
        if chosen.fits:
            return chosen
        margin = chosen.margin_bytes + chosen.excess_bytes
        try:
            tighter = choose_optimizer(dataclasses.replace(spec, memory_margin_bytes=margin), shard_optimizer)
        except PlanningError:
            break
        chosen = _with_memory(spec, tighter, margin)
    return chosen if chosen.fits else first


def _with_memory(spec: ClusterSpec, chosen: ChosenPlan, margin: int) -> ChosenPlan:
    """`chosen` with its largest worker by the memory model, planned with `margin` held back."""
    peak = plan_memory(spec.config, chosen.plan, device_type=spec.device_type, sharded_optimizer=chosen.sharded)
    return dataclasses.replace(chosen, memory=peak, margin_bytes=margin)


def choose_optimizer(spec: ClusterSpec, shard_optimizer: str) -> ChosenPlan:
    """The run's plan: unsharded (`off`), sharded (`on`, `sharded_plan`), or (`auto`) the sharded
    one where it has 2 slices or more, f >= 1, and is predicted faster with its parameter gather
    counted (`gather_time`; the freed memory laid fewer stages or less recomputation). `auto`
    does not shard at f = 0 (every slice would have one owner, so any loss would fall back to the
    checkpoint where full replicas might have lived on) unless nothing fits with whole moments.
    PlanningError (a ValueError) if nothing fits; with `off`, it says when sharding would."""
    if shard_optimizer not in ("off", "on", "auto"):
        raise ValueError(f"--shard-optimizer must be off, on or auto, got {shard_optimizer!r}")
    try:
        tset = cluster_templates(spec)
        plain = initial_plan(spec, tset)
    except PlanningError as exc:
        found = sharded_plan(spec, None)
        if found is None:
            raise
        if shard_optimizer == "off":
            raise PlanningError(f"{exc}; it fits with the optimizer's moments sharded (--shard-optimizer on or "
                                f"auto: each holder keeps 1/{found[0].moment_slices} of them)") from None
        return ChosenPlan(tset=found[0], plan=found[1], sharded=True, unsharded_time=None,
                          gather_time=gather_time(*found))
    if shard_optimizer == "off":
        return ChosenPlan(tset=tset, plan=plain, sharded=False, unsharded_time=plain.iteration_time)
    found = sharded_plan(spec, (tset, plain))
    assert found is not None  # the unsharded plan at least
    stset, splan = found
    gather = gather_time(stset, splan)
    faster = (spec.fault_tolerance >= 1 and plan_slices(splan) > 1
              and splan.iteration_time + gather < plain.iteration_time * (1 - 1e-9))
    if shard_optimizer == "on" or faster:
        return ChosenPlan(tset=stset, plan=splan, sharded=True, unsharded_time=plain.iteration_time,
                          gather_time=gather)
    return ChosenPlan(tset=tset, plan=plain, sharded=False, unsharded_time=plain.iteration_time)
