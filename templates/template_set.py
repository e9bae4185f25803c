"""Templates for every useful pipeline size: n in [n0, n_max].

n0 is the fewest nodes whose memory holds the model (as a pipeline, with 1F1B's in-flight
activations); n_max defaults to N - f * n0, the largest pipeline that still leaves room for f
more pipelines of n0 nodes. Each template is optimised for the share of the global batch a
pipeline of its size would get if the batch were split in proportion to nodes:
round(global_microbatches * n / N), at least 1. Instantiation re-times every template for the
microbatch count it actually gets.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from templates.cost import StageCosts
from templates.interleave import best_interleaving
from templates.profile import Profile
from templates.search import PipelineTemplate, feasible_stage_counts, search_templates

if TYPE_CHECKING:
    from templates.plan import Plan


class PlanningError(ValueError):
    """No template or plan satisfies the request; the message says what is missing."""


SizesKey = tuple[int, int, int]
"""(nodes, global microbatches, fault tolerance): what an instantiation's sizes depend on,
beside the templates."""


class SizesMemo:
    """The pipeline sizes (or the PlanningError message) of the most recent instantiations.

    A leader re-plans with one template set for its whole life, and node counts come back (a
    node fails, returns, another fails): the knapsack answer for a count it has seen is kept
    instead of recomputed. Bounded, least recently used out first.
    """

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[SizesKey, tuple[int, ...] | str] = OrderedDict()

    def get(self, key: SizesKey) -> tuple[int, ...] | str | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, key: SizesKey, value: tuple[int, ...] | str) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True, kw_only=True)
class TemplateSet:
    """The templates of one model and cluster shape, keyed by node count."""

    profile: Profile
    """The profile the templates were computed from."""
    gpus_per_node: int
    """Devices per node, the tensor-parallel degree of every stage."""
    min_nodes: int
    """n0: the fewest nodes that can hold the model."""
    max_nodes: int
    """n_max: the largest pipeline considered."""
    recompute: str = "none"
    """What the stages were allowed to recompute ("auto": each template's stages chose)."""
    virtual_stages: int = 1
    """v forced on every template of 2 or more nodes where it fits (templates/interleave.py);
    1: plain 1F1B; 0 (auto): each template's fastest v."""
    moment_slices: int = 1
    """S: the slices each layer's optimizer moments were counted in (the sharded optimizer: a
    holder keeps 1/S of them); 1: whole. A plan from these templates has at least S (f + 1)
    pipelines (`pipelines_needed`): with fewer, its holders would keep more than 1/S."""
    fallback: TemplateSet | None = None
    """The templates to plan with where these have no plan (`instantiate`, `replan`): a leader's
    templates counting whole moments behind those counting 1/S of them, for the node counts
    too small for S (f + 1) pipelines; None: no other (a model that fits only sharded)."""
    templates: Mapping[int, PipelineTemplate] = field(default_factory=dict)
    """Best template per node count in [min_nodes, max_nodes] (sizes with no layout are absent)."""
    memo: SizesMemo = field(default_factory=SizesMemo, init=False, repr=False, compare=False)
    """Instantiation sizes already computed from these templates (`choose_sizes`); a copy
    (`dataclasses.replace`) starts with none."""

    @property
    def num_layers(self) -> int:
        return self.profile.num_layers

    @property
    def sizes(self) -> list[int]:
        return sorted(self.templates)

    def template(self, num_nodes: int) -> PipelineTemplate:
        try:
            return self.templates[num_nodes]
        except KeyError:
            raise PlanningError(
                f"no pipeline template for {num_nodes} nodes (templates exist for {self.sizes})"
            ) from None

    def pipelines_needed(self, fault_tolerance: int) -> int:
        """The fewest pipelines of a plan from these templates at fault tolerance f: f + 1, times
        S (`moment_slices`): a layer's P holders keep its moments in P // (f + 1) slices
        (`optim_slices.slice_count`), so 1/S each only where P >= S (f + 1)."""
        return (fault_tolerance + 1) * self.moment_slices

    def serving(self, plan: Plan) -> TemplateSet:
        """The templates `plan` can have come from: these, or (too few pipelines for these) the fallback's."""
        if self.fallback is None or len(plan.pipelines) >= self.pipelines_needed(plan.fault_tolerance):
            return self
        return self.fallback.serving(plan)

    def to_list(self) -> list[dict[str, Any]]:
        return [self.templates[n].to_dict() for n in self.sizes]


def build_templates(
    profile: Profile,
    *,
    gpus_per_node: int,
    num_nodes: int,
    fault_tolerance: int,
    global_microbatches: int,
    max_nodes: int | None = None,
    recompute: str = "none",
    virtual_stages: int = 1,
    moment_slices: int = 1,
) -> TemplateSet:
    """Templates for pipelines of n0 .. n_max nodes for a cluster of `num_nodes` nodes, each
    stage recomputing as `recompute` says ("auto": the planner's choice per stage), with
    `virtual_stages` model chunks per node where the pipeline has 2 or more nodes (0: the
    fastest that fits, per template), each holder keeping 1/`moment_slices` of its layers'
    optimizer moments (the sharded optimizer; 1: all of them)."""
    if virtual_stages < 0:
        raise PlanningError(f"virtual stages must be >= 1, or 0 (auto), got {virtual_stages}")
    if num_nodes < 1:
        raise PlanningError(f"the cluster needs at least 1 node, got {num_nodes}")
    if fault_tolerance < 0:
        raise PlanningError(f"fault tolerance must be >= 0, got {fault_tolerance}")
    if global_microbatches < fault_tolerance + 1:
        raise PlanningError(
            f"{global_microbatches} microbatches cannot feed the {fault_tolerance + 1} pipelines "
            f"fault tolerance {fault_tolerance} needs"
        )
    costs = StageCosts(profile, gpus_per_node, recompute, moment_slices)
    feasible = feasible_stage_counts(costs, profile.num_layers)
    if not feasible:
        budget = profile.device.budget_bytes - profile.memory.worker_bytes
        raise PlanningError(
            f"the model does not fit in nodes of {gpus_per_node} x {profile.device.memory_bytes / 2**30:.2f} GiB "
            f"({budget / 2**30:.3f} GiB per device for the stage after the reserve and fixed buffers) "
            f"even with one layer per node"
        )
    n0 = feasible[0]
    n_max = num_nodes - fault_tolerance * n0 if max_nodes is None else max_nodes
    if n_max < n0:
        raise PlanningError(
            f"fault tolerance {fault_tolerance} needs {fault_tolerance + 1} pipelines of at least {n0} nodes "
            f"= {(fault_tolerance + 1) * n0} nodes, but the cluster has {num_nodes}"
        )
    n_max = min(n_max, profile.num_layers)
    shares = {n: max(1, round(global_microbatches * n / num_nodes)) for n in range(n0, n_max + 1)}
    return TemplateSet(
        profile=profile,
        gpus_per_node=gpus_per_node,
        min_nodes=n0,
        max_nodes=n_max,
        recompute=recompute,
        virtual_stages=virtual_stages,
        moment_slices=moment_slices,
        templates={n: best_interleaving(t, costs, virtual_stages)
                   for n, t in search_templates(costs, shares).items()},
    )
