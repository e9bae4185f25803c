"""Re-planning after nodes are lost or gained, moving as few layer bytes as possible.

Candidates, as in the Oobleck paper:
- keep: every pipeline keeps its surviving nodes and switches to the template of its new size;
  new nodes first top up pipelines that fell below n0, then form a pipeline of their own if
  they can, else join the smallest pipelines;
- borrow: a pipeline left below n0 takes nodes from the largest pipeline, if that one stays
  valid;
- merge: two short pipelines (or a short one and the smallest) become one;
- fastest: the sizes of the fastest instantiation, laid over the old pipelines largest-first.
Among the candidates whose iteration time is within `tolerance` of the fastest, the one that
moves the fewest bytes wins (then the faster, then the order above). Inside a pipeline, the
kept nodes stay in their old layer order and new nodes go where they cost least.

A node must fetch every layer of its new stage it did not hold before: weights plus optimizer
state (`Profile.layer_bytes`); each of its G workers fetches its 1/G shard.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from templates.instantiation import choose_sizes, plan_of, split_microbatches, template_stages
from templates.plan import PipelinePlan, Plan, StagePlan
from templates.template_set import PlanningError, TemplateSet


@dataclass(frozen=True, kw_only=True)
class Replan:
    """The new plan and what it costs to get there."""

    plan: Plan
    """The plan over the new node set."""
    fetch_bytes: Mapping[int, int]
    """Bytes each node of the new plan must fetch (all its workers together; 0 if none)."""
    strategy: str
    """How the plan was formed: 'keep', 'keep+borrow', 'keep+merge', 'fastest', ..."""
    gpus_per_node: int = 1
    """Workers per node; each fetches a 1/G shard."""

    @property
    def total_fetch_bytes(self) -> int:
        return sum(self.fetch_bytes.values())

    @property
    def worker_fetch_bytes(self) -> dict[int, int]:
        """Bytes each worker of a node fetches (its tensor-parallel shard), per node."""
        g = self.gpus_per_node
        return {node: -(-b // g) for node, b in self.fetch_bytes.items()}


def replan(
    tset: TemplateSet,
    current: Plan,
    nodes: Sequence[int],
    *,
    global_microbatches: int | None = None,
    fault_tolerance: int | None = None,
    tolerance: float = 0.05,
) -> Replan:
    """Re-plan `current` for the live node set `nodes` (lost nodes absent, new ones added): with
    at least `tset.pipelines_needed(f)` pipelines, from `tset.fallback`'s templates where these
    have no plan."""
    if current.num_layers != tset.num_layers:
        raise PlanningError(f"the plan has {current.num_layers} layers but the templates {tset.num_layers}")
    if tolerance < 0:
        raise PlanningError(f"tolerance must be >= 0, got {tolerance}")
    live = sorted(set(nodes))
    if len(live) != len(nodes):
        raise PlanningError("node ids must be distinct")
    mbs = current.global_microbatches if global_microbatches is None else global_microbatches
    f = current.fault_tolerance if fault_tolerance is None else fault_tolerance
    alive = set(live)
    survivors, stage_of, lost, gained = _survey(current, alive)
    _check_survivors(current, stage_of, alive, lost)

    try:
        fastest_sizes = choose_sizes(tset, len(live), global_microbatches=mbs, fault_tolerance=f)
    except PlanningError:
        if tset.fallback is None:
            raise
        return replan(tset.fallback, current, nodes, global_microbatches=mbs, fault_tolerance=f, tolerance=tolerance)
    prefix = list(itertools.accumulate((tset.profile.layer_bytes(i) for i in range(tset.num_layers)), initial=0))
    builder = _Builder(tset, current, stage_of, prefix, mbs, f)
    options: list[tuple[str, list[list[int]]]] = []
    kept = _keep_groups(tset, survivors, gained)
    if kept is not None:
        options.append(kept)
    options.append(("fastest", _fastest_groups(fastest_sizes, survivors, gained)))

    built = []
    for rank, (label, groups) in enumerate(options):
        if not tset.pipelines_needed(f) <= len(groups) <= mbs:
            continue
        built.append((builder.evaluate(groups), label, rank))
    best_time = min(c.iteration_time for c, _, _ in built)
    eligible = [b for b in built if b[0].iteration_time <= best_time * (1 + tolerance)]
    chosen, label, _ = min(eligible, key=lambda b: (b[0].total_fetch, b[0].iteration_time, b[2]))
    return Replan(plan=builder.plan(chosen), fetch_bytes=chosen.fetch_bytes(), strategy=label,
                  gpus_per_node=tset.gpus_per_node)


def _survey(
    current: Plan, alive: set[int]
) -> tuple[list[Sequence[int]], dict[int, StagePlan], list[int], list[int]]:
    """Each pipeline's live nodes in stage order (pipelines left empty dropped), the stage each
    current node runs, the lost nodes and the new ones. Only a pipeline that lost a node is
    read node by node (at thousands of nodes, most of them lost none)."""
    survivors: list[Sequence[int]] = []
    lost: list[int] = []
    for pipe in current.pipelines:
        if alive.issuperset(pipe.nodes):
            survivors.append(pipe.nodes)
        else:
            survivors.append([n for n in pipe.nodes if n in alive])
            lost.extend(n for n in pipe.nodes if n not in alive)
    survivors = [g for g in survivors if g]
    pipes = current.pipelines
    stage_of = dict(zip(itertools.chain.from_iterable(p.nodes for p in pipes),
                        itertools.chain.from_iterable(p.stages for p in pipes), strict=True))
    gained = sorted(alive.difference(stage_of)) if sum(map(len, survivors)) < len(alive) else []
    return survivors, stage_of, sorted(lost), gained


def _check_survivors(current: Plan, stage_of: dict[int, StagePlan], live: set[int], lost: list[int]) -> None:
    # Every pipeline holds every layer once (a valid plan), so a layer's live holders are the
    # pipelines less the lost nodes holding it: only the lost nodes need reading.
    lost_holders = np.zeros(current.num_layers + 1, dtype=np.int64)  # as differences
    for node in lost:
        for first, last in stage_of[node].ranges:
            lost_holders[first] += 1
            lost_holders[last] -= 1
    if len(current.pipelines) - np.cumsum(lost_holders)[:-1].max() > 0:
        return
    for layer in range(current.num_layers):  # the first layer without one, named with its holders
        holders = [st.node for pipe in current.pipelines for st in pipe.stages if st.holds(layer)]
        if not any(node in live for node in holders):
            raise PlanningError(
                f"layer {layer} has no surviving holder: lost nodes {lost} held all its replicas "
                f"{sorted(holders)} (more than fault tolerance {current.fault_tolerance} allows); "
                f"restart from the last checkpoint"
            )


def _keep_groups(
    tset: TemplateSet, survivors: Sequence[Sequence[int]], gained: list[int]
) -> tuple[str, list[list[int]]] | None:
    """Survivors stay in their pipelines; repairs by new nodes, borrowing, then merging."""
    sizes = set(tset.templates)

    def valid(size: int) -> bool:
        return size in sizes

    n0 = tset.min_nodes
    groups = [list(g) for g in survivors]
    pool = list(gained)
    tags: list[str] = []
    # New nodes top up the shortest broken pipelines first.
    for g in sorted(groups, key=len):
        while pool and len(g) < n0:
            g.append(pool.pop(0))
    if pool:
        if valid(len(pool)):
            groups.append(pool)
        else:
            for node in pool:
                growable = [g for g in groups if len(g) + 1 in sizes]
                if not growable:
                    return None
                min(growable, key=len).append(node)
    while True:
        broken = sorted((g for g in groups if len(g) not in sizes), key=len)
        if not broken:
            break
        g = broken[0]
        donor = _donor(groups, g, valid)
        if donor is not None:
            h, need = donor
            g.extend(h[len(h) - need :])
            del h[len(h) - need :]
            tags.append("borrow")
            continue
        partner = _partner(groups, g, broken, valid)
        if partner is None:
            return None
        partner.extend(g)
        groups.remove(g)
        tags.append("merge")
    label = "+".join(["keep", *sorted(set(tags))])
    return label, groups


def _donor(groups: list[list[int]], g: list[int], valid: Callable[[int], bool]) -> tuple[list[int], int] | None:
    """The largest pipeline that can give g the fewest nodes making both valid."""
    for h in sorted((h for h in groups if h is not g), key=len, reverse=True):
        for need in range(1, len(h)):
            if valid(len(g) + need) and valid(len(h) - need):
                return h, need
    return None


def _partner(
    groups: list[list[int]], g: list[int], broken: list[list[int]], valid: Callable[[int], bool]
) -> list[int] | None:
    """Another short pipeline to merge g with, else the smallest pipeline that makes a valid one."""
    for h in [*broken[1:], *sorted((h for h in groups if h is not g), key=len)]:
        if valid(len(g) + len(h)):
            return h
    return None


def _fastest_groups(sizes: list[int], survivors: Sequence[Sequence[int]], gained: list[int]) -> list[list[int]]:
    """The fastest sizes, each seeded with the survivors of one old pipeline, largest first."""
    old = sorted(survivors, key=len, reverse=True)
    seeds = [*old[: len(sizes)], *[()] * (len(sizes) - len(old))]
    groups = [list(seed[:size]) for seed, size in zip(seeds, sizes, strict=True)]
    pool = [*itertools.chain.from_iterable(seed[size:] for seed, size in zip(seeds, sizes, strict=True)),
            *itertools.chain.from_iterable(old[len(sizes) :]), *gained]
    taken = 0  # the pool fills the groups in order
    for group, size in zip(groups, sizes, strict=True):
        missing = size - len(group)
        if missing > 0:
            group.extend(pool[taken : taken + missing])
            taken += missing
    assert taken == len(pool), "sizes must cover every live node"
    return groups


@dataclass(frozen=True, kw_only=True)
class _Candidate:
    """Node groups in stage order, their microbatches and what they would fetch: a plan not built yet."""

    groups: list[list[int]]
    """Each pipeline's nodes, in stage order."""
    counts: list[int]
    """Each pipeline's microbatches."""
    times: list[float]
    """Each pipeline's time for them."""
    kept: list[PipelinePlan | None]
    """The current plan's pipeline a group runs unchanged (same nodes, order and layout), if any."""
    fetch: dict[int, int]
    """Bytes each node of a changed group fetches (the others: none)."""
    iteration_time: float
    """The slowest pipeline's time."""

    @property
    def total_fetch(self) -> int:
        return sum(self.fetch.values())

    def fetch_bytes(self) -> dict[int, int]:
        """Bytes every node fetches, pipeline by pipeline."""
        out = dict.fromkeys(itertools.chain.from_iterable(self.groups), 0)
        out.update(self.fetch)
        return out


class _Builder:
    """Turns node groups into a plan, ordering each group's nodes to fetch the fewest bytes.

    A re-plan at thousands of nodes leaves almost every pipeline as it was: a group that is one
    of the current pipelines, with the same template layout, fetches nothing and keeps its
    stages, so only the changed pipelines cost per-node work.
    """

    def __init__(self, tset: TemplateSet, current: Plan, stage_of: dict[int, StagePlan], prefix: list[int],
                 mbs: int, f: int) -> None:
        self.tset, self.stage_of, self.prefix, self.mbs, self.f = tset, stage_of, prefix, mbs, f
        self.current = {pipe.nodes: pipe for pipe in current.pipelines}
        self.templates = dict(tset.templates)

    def fetch(self, node: int, ranges: tuple[tuple[int, int], ...]) -> int:
        """Bytes `node` lacks of the layers in `ranges` (its chunks)."""
        stage = self.stage_of.get(node)
        held = stage.ranges if stage is not None else ()
        total = 0
        for first, last in ranges:
            total += self.prefix[last] - self.prefix[first]
            for a, b in held:
                lo, hi = max(first, a), min(last, b)
                total -= self.prefix[hi] - self.prefix[lo] if lo < hi else 0
        return total

    def order(self, group: list[int]) -> list[int]:
        template = self.templates[len(group)]
        stages = template.chunks or tuple((rng,) for rng in template.stages)
        old = sorted((n for n in group if n in self.stage_of), key=lambda n: (self.stage_of[n].ranges[0], n))
        new = sorted(n for n in group if n not in self.stage_of)
        if not new:  # the only option
            return old
        options = [old[:i] + new + old[i:] for i in range(len(old) + 1)]
        return min(options, key=lambda o: sum(self.fetch(n, r) for n, r in zip(o, stages, strict=True)))

    def evaluate(self, groups: list[list[int]]) -> _Candidate:
        # A group that is a current pipeline laid out as its template is: `order` would keep
        # its nodes in their stage order (ascending layers), and they fetch nothing.
        found = map(self.current.get, map(tuple, groups))
        kept = [p if p is not None and p.layout == self.templates[len(p.stages)].layout else None for p in found]
        ordered = [g if p is not None else self.order(g) for g, p in zip(groups, kept, strict=True)]
        fetch: dict[int, int] = {}  # the nodes of changed groups; the others fetch nothing
        for nodes, pipe in zip(ordered, kept, strict=True):
            if pipe is None:
                template = self.templates[len(nodes)]
                for node, ranges in zip(nodes, template.chunks or tuple((rng,) for rng in template.stages), strict=True):
                    fetch[node] = self.fetch(node, ranges)
        templates = [self.templates[len(g)] for g in ordered]  # every candidate's sizes have templates
        counts = split_microbatches(templates, self.mbs)
        times = [t.time_for(c) for t, c in zip(templates, counts, strict=True)]
        return _Candidate(groups=ordered, counts=counts, times=times, kept=kept, fetch=fetch, iteration_time=max(times))

    def plan(self, chosen: _Candidate) -> Plan:
        """The candidate's plan: a kept pipeline's stages as they are, the others from their template."""
        pipelines = []
        for group, count, seconds, pipe in zip(chosen.groups, chosen.counts, chosen.times, chosen.kept, strict=True):
            if pipe is None:
                pipelines.append(PipelinePlan(stages=template_stages(self.templates[len(group)], group),
                                              microbatches=count, iteration_time=seconds))
            elif pipe.microbatches == count and pipe.iteration_time == seconds:
                pipelines.append(pipe)
            else:
                pipelines.append(PipelinePlan(stages=pipe.stages, microbatches=count, iteration_time=seconds))
        return plan_of(self.tset, pipelines, fault_tolerance=self.f)
