"""The real planner, as the policies use it, with the answers cached per node count.

Three template sets come from one profile, each built once for the initial cluster:

- `elastic`: the runtime's templates (fault tolerance f); plans come from `instantiate` and,
  after a change, from `templates.replanning.replan`, exactly as the leader calls them;
- `flat`: the same profile at f = 0, for the checkpoint-restart policy;
- `redundant`: a profile in which every stage also holds and runs its successor's layers (see
  `redundant_profile`), for the redundant-computation policy.

Checkpoint-restart and redundant plans are homogeneous (Varuna and Bamboo run D identical
pipelines of depth d): for n nodes, the best template depth d and D = n // d pipelines (at
most one per microbatch); the n - D d leftover nodes idle as spares.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from elastic.planning.cluster import ClusterSpec
from templates.instantiation import build_plan, instantiate, split_microbatches
from templates.plan import PipelinePlan, Plan, StagePlan
from templates.profile import Profile
from templates.template_set import PlanningError, TemplateSet, build_templates

_PIPELINES_KEPT = 1 << 16
"""Homogeneous pipelines `PlanBook` remembers before it starts afresh (a few per node and kind)."""


@dataclass(frozen=True, kw_only=True)
class Shape:
    """A homogeneous layout: `pipelines` pipelines of `depth` nodes."""

    depth: int
    """Nodes (= stages) per pipeline."""
    pipelines: int
    """Identical pipelines (data-parallel width)."""
    iteration_time: float
    """Seconds per optimizer step from the planner's cost model."""
    planning_s: float
    """Wall time the planner took to find it (measured once per node count)."""


def redundant_profile(profile: Profile, forward_fraction: float) -> Profile:
    """Each layer also carries its successor's copy: weights, gradients and AdamW state doubled,
    and `forward_fraction` of an extra forward pass added to its compute.

    Per layer rather than per stage: a stage's successor holds about as many layers as the stage
    itself when stages are balanced, which the template search makes them.
    """
    layers = tuple(
        replace(
            ly,
            forward=ly.forward * (1.0 + forward_fraction),
            param_bytes=2 * ly.param_bytes,
            optimizer_bytes=2 * ly.optimizer_bytes,
        )
        for ly in profile.layers
    )
    notes = f"{profile.notes}; redundant copy of the successor's layers (forward x{1 + forward_fraction:g}, state x2)"
    return replace(profile, layers=layers, notes=notes)


class PlanBook:
    """Template sets and per-node-count plans for every policy, computed once and cached."""

    def __init__(self, cluster: ClusterSpec, profile: Profile, *, redundant_forward: float) -> None:
        self.cluster = cluster
        self.profile = profile
        self.mbs = cluster.global_microbatches
        self.f = cluster.fault_tolerance
        self.elastic = self._templates(profile, cluster.fault_tolerance)
        self.flat = self._templates(profile, 0)
        self.redundant_profile = redundant_profile(profile, redundant_forward)
        try:
            self.redundant: TemplateSet | None = self._templates(self.redundant_profile, 0)
            self.redundant_error = ""
        except PlanningError as exc:
            self.redundant, self.redundant_error = None, str(exc)
        self._best: dict[int, float | None] = {}
        self._shapes: dict[tuple[str, int], Shape | None] = {}
        self._splits: dict[tuple[str, int], Plan] = {}
        self._pipelines: dict[tuple[str, int, float, tuple[int, ...]], PipelinePlan] = {}

    def _templates(self, profile: Profile, f: int) -> TemplateSet:
        c = self.cluster
        return build_templates(
            profile, gpus_per_node=c.gpus_per_node, num_nodes=c.nodes, fault_tolerance=f, global_microbatches=self.mbs,
            recompute=c.recompute, virtual_stages=c.virtual_stages,
        )

    def layers_bytes(self, first: int, last: int) -> int:
        """Weights plus AdamW state of layers [first, last): what a node fetches to hold them."""
        return sum(self.profile.layer_bytes(i) for i in range(first, last))

    def stage_bytes(self, stage: StagePlan) -> int:
        """Weights plus AdamW state of every layer a stage holds (each of its chunks)."""
        return sum(self.layers_bytes(first, last) for first, last in stage.ranges)

    @property
    def model_bytes(self) -> int:
        """One replica's weights plus AdamW state: what a checkpoint holds."""
        return self.layers_bytes(0, self.profile.num_layers)

    def initial_plan(self) -> Plan:
        return instantiate(
            self.elastic, list(range(self.cluster.nodes)), global_microbatches=self.mbs, fault_tolerance=self.f
        )

    def best_time(self, n: int) -> float | None:
        """Iteration time of the fastest elastic plan over n nodes (f relaxed like the leader does);
        None if no plan fits."""
        if n not in self._best:
            self._best[n] = None
            for f in range(self.f, -1, -1):
                try:
                    plan = instantiate(self.elastic, list(range(n)), global_microbatches=self.mbs, fault_tolerance=f)
                except PlanningError:
                    continue
                self._best[n] = plan.iteration_time
                break
        return self._best[n]

    def shape(self, kind: str, n: int) -> Shape | None:
        """The best homogeneous layout over n nodes for `kind` ('flat' or 'redundant')."""
        key = (kind, n)
        if key not in self._shapes:
            start = time.perf_counter()
            best = self._search_shape(kind, n)
            self._shapes[key] = (
                None if best is None else Shape(depth=best[0], pipelines=best[1], iteration_time=best[2],
                                                planning_s=time.perf_counter() - start)
            )
        return self._shapes[key]

    def shape_plan(self, kind: str, nodes: list[int]) -> Plan | None:
        """The homogeneous plan over `nodes` (sorted ids dealt into pipelines; spares left over):
        `build_plan`'s plan, its microbatch split computed once per node count."""
        shape = self.shape(kind, len(nodes))
        if shape is None:
            return None
        ordered = sorted(nodes)
        key = (kind, len(nodes))
        if key not in self._splits:
            groups = [ordered[p * shape.depth : (p + 1) * shape.depth] for p in range(shape.pipelines)]
            plan = build_plan(self._tset(kind), groups, global_microbatches=self.mbs, fault_tolerance=0)
            self._splits[key] = plan
            return plan
        like = self._splits[key]  # the same layout and split over other node ids
        pipes = tuple(self._pipeline(kind, pipe, tuple(ordered[p * shape.depth : (p + 1) * shape.depth]))
                      for p, pipe in enumerate(like.pipelines))
        return replace(like, pipelines=pipes)

    def _pipeline(self, kind: str, like: PipelinePlan, nodes: tuple[int, ...]) -> PipelinePlan:
        """`like` (a pipeline of the `kind` template of its depth) run by `nodes`. Remembered: a
        failure shifts the later pipelines by one node and a return shifts them back, so the same
        node groups come again and again, and a pipeline made before is already validated."""
        key = (kind, like.microbatches, like.iteration_time, nodes)
        found = self._pipelines.get(key)
        if found is None:
            if len(self._pipelines) >= _PIPELINES_KEPT:
                self._pipelines.clear()
            stages = tuple(replace(st, node=node) for st, node in zip(like.stages, nodes, strict=True))
            found = self._pipelines[key] = replace(like, stages=stages)
        return found

    def _tset(self, kind: str) -> TemplateSet:
        if kind == "flat":
            return self.flat
        assert kind == "redundant" and self.redundant is not None, f"no template set {kind!r}"
        return self.redundant

    def _search_shape(self, kind: str, n: int) -> tuple[int, int, float] | None:
        if kind == "redundant" and self.redundant is None:
            return None
        tset = self._tset(kind)
        best: tuple[int, int, float] | None = None
        for depth in tset.sizes:
            width = min(n // depth, self.mbs)
            if width < 1:
                continue
            template = tset.templates[depth]
            counts = split_microbatches([template] * width, self.mbs)
            t = max(template.time_for(m) for m in counts)
            if best is None or t < best[2]:
                best = (depth, width, t)
        return best
