"""Hot spares: which live nodes train and which wait, ready, to replace a lost one.

A job trains on at most `active` nodes (the run's `--nodes`, `ClusterSpec.nodes`). Every other
live node whose workers have registered is a *spare*: its agent and workers run, torch is
imported and the model skeleton built, but it holds no layer and is in no generation. The
leader asks this module two questions, both pure functions of node sets so they are tested as
units:

- on a loss, which spares join the re-plan that drops the lost nodes (`spares_to_take`): as
  many as bring the plan back to `active` nodes, lowest node id first (deterministic: every
  leader picks the same ones). When they replace every lost node, the re-plan is the same
  instantiation with each spare in a lost node's stage (`substitute`): the same templates and
  pipelines, and only the lost nodes' shards move (to the spares, from surviving replicas);
- on a step boundary, which ready newcomers join (`newcomers_to_join`): only as many as the
  plan lacks to reach `active`; the others stay spares. The leader asks only when spares are
  configured (`--spares K`, K > 0); without, every ready newcomer joins, as it always did.

A node that comes back (a restarted node, a drained node's new incarnation) is a newcomer like
any other: it joins while the plan is short of `active` nodes, and is a spare otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping

from templates.plan import Plan


def spares_to_take(*, survivors: Collection[int], ready: Iterable[int], active: int) -> list[int]:
    """The ready spares a re-plan over `survivors` takes in: the lowest-numbered ones, as many as
    bring the node count back to `active` (none when the survivors already reach it, or when no
    spare is ready: the re-plan then runs on the survivors alone, as without spares)."""
    if active < 1:
        raise ValueError(f"the active node count must be >= 1, got {active}")
    wanted = max(0, active - len(survivors))
    return sorted(n for n in set(ready) if n not in survivors)[:wanted]


def newcomers_to_join(*, current: Collection[int], ready: Iterable[int], active: int) -> list[int]:
    """The ready newcomers a step boundary takes into a plan over `current` nodes: as many as it
    lacks to reach `active`, lowest node id first; the rest stay spares."""
    return spares_to_take(survivors=current, ready=ready, active=active)


def substitute(plan: Plan, replacements: Mapping[int, int]) -> Plan:
    """`plan` with node `new` in the stage of each lost node `old` of `replacements` (old -> new):
    the same instantiation (templates, layer ranges, microbatches, iteration time); ValueError
    if an old node is not in the plan or a new one already is."""
    nodes = set(plan.nodes)
    missing = sorted(set(replacements) - nodes)
    if missing:
        raise ValueError(f"nodes {missing} are not in the plan (nodes {sorted(nodes)})")
    taken = sorted(set(replacements.values()) & nodes)
    if taken or len(set(replacements.values())) != len(replacements):
        raise ValueError(f"replacement nodes {sorted(replacements.values())} must be distinct and new to the plan")
    pipelines = tuple(
        dataclasses.replace(pipe, stages=tuple(dataclasses.replace(st, node=replacements.get(st.node, st.node))
                                               for st in pipe.stages))
        for pipe in plan.pipelines
    )
    return dataclasses.replace(plan, pipelines=pipelines)


def spare_nodes(*, live: Iterable[int], in_generation: Collection[int]) -> list[int]:
    """The live nodes that the current generation does not include: the spares (a node that
    registered but whose workers are not all up yet counts too: it is on its way to being one)."""
    return sorted(n for n in set(live) if n not in in_generation)
