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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from templates.instantiation import build_plan, choose_sizes
from templates.plan import Plan
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
    """Re-plan `current` for the live node set `nodes` (lost nodes absent, new ones added)."""
    if current.num_layers != tset.num_layers:
        raise PlanningError(f"the plan has {current.num_layers} layers but the templates {tset.num_layers}")
    if tolerance < 0:
        raise PlanningError(f"tolerance must be >= 0, got {tolerance}")
    live = sorted(set(nodes))
    if len(live) != len(nodes):
        raise PlanningError("node ids must be distinct")
    mbs = current.global_microbatches if global_microbatches is None else global_microbatches
    f = current.fault_tolerance if fault_tolerance is None else fault_tolerance
    held = {st.node: st.ranges for pipe in current.pipelines for st in pipe.stages}
    lost = sorted(set(held) - set(live))
    _check_survivors(current, set(live), lost)

    fastest_sizes = choose_sizes(tset, len(live), global_microbatches=mbs, fault_tolerance=f)
    alive = set(live)
    survivors = [[st.node for st in pipe.stages if st.node in alive] for pipe in current.pipelines]
    survivors = [g for g in survivors if g]
    gained = sorted(set(live) - set(held))

    prefix = np.concatenate([[0], np.cumsum([tset.profile.layer_bytes(i) for i in range(tset.num_layers)])])
    builder = _Builder(tset, held, prefix, mbs, f)
    options: list[tuple[str, list[list[int]]]] = []
    kept = _keep_groups(tset, survivors, gained)
    if kept is not None:
        options.append(kept)
    options.append(("fastest", _fastest_groups(fastest_sizes, survivors, gained)))

    built = []
    for rank, (label, groups) in enumerate(options):
        if not f + 1 <= len(groups) <= mbs:
            continue
        plan, fetch = builder.build(groups)
        built.append((plan, fetch, label, rank))
    best_time = min(plan.iteration_time for plan, _, _, _ in built)
    eligible = [b for b in built if b[0].iteration_time <= best_time * (1 + tolerance)]
    plan, fetch, label, _ = min(eligible, key=lambda b: (sum(b[1].values()), b[0].iteration_time, b[3]))
    return Replan(plan=plan, fetch_bytes=fetch, strategy=label, gpus_per_node=tset.gpus_per_node)


def _check_survivors(current: Plan, live: set[int], lost: list[int]) -> None:
    held = np.zeros(current.num_layers + 1, dtype=np.int64)  # live holders per layer, as differences
    for pipe in current.pipelines:
        for st in pipe.stages:
            for first, last in st.ranges if st.node in live else ():
                held[first] += 1
                held[last] -= 1
    if np.cumsum(held)[:-1].min() > 0:
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
    tset: TemplateSet, survivors: list[list[int]], gained: list[int]
) -> tuple[str, list[list[int]]] | None:
    """Survivors stay in their pipelines; repairs by new nodes, borrowing, then merging."""
    def valid(size: int) -> bool:
        return size in tset.templates

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
                growable = [g for g in groups if valid(len(g) + 1)]
                if not growable:
                    return None
                min(growable, key=len).append(node)
    while True:
        broken = sorted((g for g in groups if not valid(len(g))), key=len)
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


def _fastest_groups(sizes: list[int], survivors: list[list[int]], gained: list[int]) -> list[list[int]]:
    """The fastest sizes, each seeded with the survivors of one old pipeline, largest first."""
    old = sorted(survivors, key=len, reverse=True)
    groups: list[list[int]] = []
    pool: list[int] = []
    for i, size in enumerate(sizes):
        seed = old[i] if i < len(old) else []
        groups.append(seed[:size])
        pool.extend(seed[size:])
    for seed in old[len(sizes) :]:
        pool.extend(seed)
    pool.extend(gained)
    for group, size in zip(groups, sizes, strict=True):
        while len(group) < size:
            group.append(pool.pop(0))
    assert not pool, "sizes must cover every live node"
    return groups


class _Builder:
    """Turns node groups into a plan, ordering each group's nodes to fetch the fewest bytes."""

    def __init__(
        self, tset: TemplateSet, held: dict[int, tuple[tuple[int, int], ...]], prefix: np.ndarray, mbs: int, f: int
    ) -> None:
        self.tset, self.held, self.prefix, self.mbs, self.f = tset, held, prefix, mbs, f

    def fetch(self, node: int, ranges: tuple[tuple[int, int], ...]) -> int:
        """Bytes `node` lacks of the layers in `ranges` (its chunks)."""
        total = 0
        for first, last in ranges:
            total += int(self.prefix[last] - self.prefix[first])
            for a, b in self.held.get(node, ()):
                lo, hi = max(first, a), min(last, b)
                total -= int(self.prefix[hi] - self.prefix[lo]) if lo < hi else 0
        return total

    def order(self, group: list[int]) -> list[int]:
        template = self.tset.template(len(group))
        stages = template.chunks or tuple((rng,) for rng in template.stages)
        old = sorted((n for n in group if n in self.held), key=lambda n: (self.held[n][0], n))
        new = sorted(n for n in group if n not in self.held)
        if not new:  # the only option
            return old
        options = [old[:i] + new + old[i:] for i in range(len(old) + 1)]
        return min(options, key=lambda o: sum(self.fetch(n, r) for n, r in zip(o, stages, strict=True)))

    def build(self, groups: list[list[int]]) -> tuple[Plan, dict[int, int]]:
        ordered = [self.order(g) for g in groups]
        plan = build_plan(self.tset, ordered, global_microbatches=self.mbs, fault_tolerance=self.f)
        fetch = {st.node: self.fetch(st.node, st.ranges) for pipe in plan.pipelines for st in pipe.stages}
        return plan, fetch
