"""The leader's re-planning: the plan of generation g+1 and the spares it takes in, as pure
functions of a round's snapshot (roles/leader_snapshot.py), and the one piece with I/O, the
search of the checkpoint directory for a fallback (files only, never etcd).

- `replan_after`: the plan of g+1 over the live nodes after a loss or a join. Hot spares that
  replace every lost node take their stages in the same instantiation; else the live nodes are
  re-planned on the precomputed templates, relaxing f only as far as needed. When a layer has no
  live holder (what live workers report holding decides, not the plan), or no plan fits, it
  returns a `Fallback`: the plan is rebuilt from scratch by `fallback_plan` and every worker
  restores the latest complete checkpoint (`verified_checkpoint`).
- `drain_plan`: the plan without a drained node (a ready spare in its stage, or a re-plan of
  the others), or why the drain cannot be met.
- `ready_spares`, `joining`, `spares_for_loss`, `spare_for_drain`: which ready newcomers join,
  stay spares, or take a lost or drained node's stage (elastic/planning/spares.py).
- `resume_point`: the first step of g+1 and the vote of the step before it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from elastic.planning.spares import newcomers_to_join, spares_to_take, substitute
from elastic.planning.stragglers import planner_split
from elastic.records.config import ElasticConfig
from elastic.records.generation import GenerationRecord, Vote
from elastic.records.sync import SyncReport
from elastic.roles.leader_snapshot import Holdings, Snapshot
from elastic.transfer.shards import ShardKey
from templates.instantiation import instantiate
from templates.optim_slices import SliceOwnership, lost_slices
from templates.plan import Plan
from templates.replanning import replan
from templates.template_set import PlanningError, TemplateSet


class FallbackImpossible(RuntimeError):
    """The survivors lost a layer and there is no complete checkpoint to restore."""


@dataclass(frozen=True, kw_only=True)
class Fallback:
    """No plan keeps the survivors' state: rebuild one over `live` and restore a checkpoint."""

    what: str
    """What changed, in words ("lost node 1, node 4 joined")."""
    gaps: list[ShardKey]
    """Shards without a live holder (empty: the shards are there, but too few nodes for f+1 pipelines)."""
    live: list[int]
    """The nodes of the next generation."""
    cause: str = ""
    """Why no plan keeps the state, when neither of `gaps`' reasons (a lost optimizer slice)."""


NODE_LIST_MAX = 16
"""Longest list of nodes a generation's reason spells out one by one (the record reaches every node)."""


def node_list(nodes: list[int]) -> str:
    """`nodes` for a reason text: the list itself up to NODE_LIST_MAX nodes, else its runs
    ("[0-1270, 1273-2046] (2046 nodes)"), so that the record's size does not grow with the job."""
    if len(nodes) <= NODE_LIST_MAX:
        return str(nodes)
    runs: list[list[int]] = []
    for n in sorted(nodes):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    spans = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"[{spans}] ({len(nodes)} nodes)"


def surviving_holders_cover(plan: Plan, live: set[int]) -> bool:
    """Whether every layer of `plan` has a holder among `live` nodes."""
    return all(
        any(st.node in live for pipe in plan.pipelines for st in pipe.stages if st.holds(layer))
        for layer in range(plan.num_layers)
    )


def holdings_gaps(holdings: Holdings, plan: Plan, live: set[int]) -> list[ShardKey] | None:
    """The (layer, tp_rank) shards that no live worker reports holding; None when no worker has
    reported yet (nothing trained: the seed state is everywhere)."""
    if not holdings:
        return None
    held = {shard for (node, _), shards in holdings.items() if node in live for shard in shards}
    return [
        ShardKey(layer, t)
        for layer in range(plan.num_layers)
        for t in range(plan.gpus_per_node)
        if (layer, t) not in held
    ]


MomentSpans = Sequence[tuple[int, int, int, int, int]]
"""A worker's report of the moments it has (SyncReport.moments): (layer, tp_rank, lo, hi, total)."""


def moments_without_holder(reported: Iterable[MomentSpans | None]) -> list[str] | None:
    """Each element range of a shard's moments that no report in `reported` (the live workers')
    has, in words; None when some report carries none (not sharded, or a worker that has not
    halted yet): the plan's owners decide then. A shard that no one reports is a layer gap
    (`holdings_gaps`), not this."""
    have: dict[tuple[int, int], tuple[int, list[tuple[int, int]]]] = {}
    for spans in reported:
        if spans is None:
            return None
        for layer, tp, lo, hi, total in spans:
            have.setdefault((layer, tp), (total, []))[1].append((lo, hi))
    missing = []
    for (layer, tp), (total, ranges) in sorted(have.items()):
        at = 0
        for lo, hi in sorted(r for r in ranges if r[0] < r[1]) + [(total, total)]:
            if lo > at:
                missing.append(f"layer {layer}, optimizer elements [{at}, {lo}) of tensor-parallel rank {tp}: "
                               "no live worker has their moments (lost with their owners before a repair moved them)")
            at = max(at, hi)
    return missing


def _lost_moments(owners: Mapping[int, SliceOwnership], lost: set[int],
                  moments: Sequence[MomentSpans | None] | None) -> str:
    """Why the optimizer's state cannot be kept (a Fallback's cause), or "" when it can. What
    the live workers report having decides (a generation superseded before its repair left its
    new owners without their slices); the slices whose every owner is lost name it when the
    reports show a loss, or decide alone without reports."""
    gone = [str(x) for x in lost_slices(owners, lost)]
    missing = None if moments is None else moments_without_holder(moments)
    if missing is not None and not missing:
        return ""
    named = gone or missing or []
    more = f" (and {len(named) - 1} more)" if len(named) > 1 else ""
    return f"{named[0]}{more}" if named else ""


def whole_moments(tset: TemplateSet, plan: Plan, sep: str) -> str:
    """What a reason adds (after `sep`) when `plan` came from the templates counting whole moments
    behind the run's sharded ones (too few nodes for the pipelines that keep 1/S of them): else nothing."""
    if tset.serving(plan) is tset:
        return ""
    need = tset.pipelines_needed(plan.fault_tolerance)
    return (f"{sep} {len(plan.pipelines)} pipelines, fewer than the {need} that keep 1/{tset.moment_slices} of "
            f"the optimizer's moments a holder: planned with whole moments")


def replan_after(tset: TemplateSet, plan: Plan, live: list[int], holdings: Holdings, *, lost: list[int],
                 joined: list[int], owners: Mapping[int, SliceOwnership] | None = None,
                 moments: Sequence[MomentSpans | None] | None = None) -> tuple[Plan, str] | Fallback:
    """The plan of g+1 over `live` and its reason, or a Fallback (module doc). `owners`: the
    sharded optimizer's slice owners under `plan` (issue 55; None: not sharded), `moments`: what
    each live worker reports having of them (SyncReport.moments): optimizer elements that no
    live worker has are a Fallback too, named in its cause (`_lost_moments`)."""
    what = ", ".join([*(f"lost node {n}" for n in lost), *(f"node {n} joined" for n in joined)])
    f = plan.fault_tolerance
    # What live workers report holding decides, not the plan: a reconfiguration cut short by
    # a second failure may have left a plan's holder without its shards.
    gaps = holdings_gaps(holdings, plan, set(live))
    if gaps is None:
        gaps = [] if surviving_holders_cover(plan, set(live)) else [ShardKey(-1, -1)]
    if not gaps and owners is not None:
        cause = _lost_moments(owners, set(plan.nodes) - set(live), moments)
        if cause:
            return Fallback(what=what, gaps=[], live=live, cause=cause)
    if not gaps and lost and len(joined) == len(lost) and not set(joined) & set(plan.nodes):
        # Hot spares replace every lost node: the same instantiation, each spare in a lost
        # node's stage (elastic/planning/spares.py); it fetches that node's shards.
        swap = dict(zip(sorted(lost), sorted(joined), strict=True))
        return (substitute(plan, swap),
                f"{what}: hot spare(s) took the lost nodes' stages ({', '.join(f'{n} -> {s}' for n, s in swap.items())})")
    if not gaps:
        for f_now in range(f, -1, -1):
            try:
                new = replan(tset, plan, live, global_microbatches=plan.global_microbatches, fault_tolerance=f_now).plan
            except PlanningError:
                continue
            relaxed = "" if f_now == f else f"; fault tolerance relaxed from {f} to {f_now}"
            return new, f"{what}: re-planned over nodes {node_list(live)}{relaxed}{whole_moments(tset, new, ';')}"
    return Fallback(what=what, gaps=gaps, live=live)


def fallback_plan(tset: TemplateSet, plan: Plan, fallback: Fallback, *, checkpoint: int, steps: int,
                  skipped: list[tuple[int, str]]) -> tuple[Plan, str]:
    """A plan from scratch over the fallback's live nodes, relaxing f only as far as needed, and
    its reason (restoring `checkpoint` of a `steps`-step job; `skipped`: newer corrupt ones)."""
    f, live, gaps = plan.fault_tolerance, fallback.live, fallback.gaps
    for f_now in range(f, -1, -1):
        try:
            new = instantiate(tset, live, global_microbatches=plan.global_microbatches, fault_tolerance=f_now)
        except PlanningError:
            continue
        relaxed = "" if f_now == f else f", fault tolerance relaxed from {f} to {f_now}"
        relaxed += whole_moments(tset, new, ",")
        why = fallback.cause or (f"shards {gaps} have no live holder" if gaps else f"too few nodes for {f + 1} pipelines")
        return new, (
            f"{fallback.what}: {why}; "
            f"CHECKPOINT FALLBACK: restoring step {checkpoint} of {steps} on nodes {live}{relaxed}"
            + "".join(f"; skipped the corrupt checkpoint of step {step}" for step, _ in skipped)
        )
    raise FallbackImpossible(f"{fallback.what}: no plan fits the live nodes {live} even with fault tolerance 0")


def verified_checkpoint(directory: Path, plan: Plan) -> tuple[int | None, list[tuple[int, str]]]:
    """The newest complete checkpoint in `directory` whose every file matches its marker's
    CRC-32, and the newer complete ones skipped as corrupt (step, why), newest first. Reading
    every file is a fallback's cost, never a step's."""
    from elastic.engine.checkpoint.files import CheckpointError, complete_steps
    from elastic.engine.checkpoint.resume import verify_crcs

    skipped: list[tuple[int, str]] = []
    for step in reversed(complete_steps(directory, num_layers=plan.num_layers, tp_degree=plan.gpus_per_node)):
        try:
            verify_crcs(directory, step)
        except CheckpointError as exc:
            skipped.append((step, str(exc)))
            continue
        return step, skipped
    return None, skipped


def restore_dir(config: ElasticConfig, restore: int | None) -> str | None:
    """Where checkpoint step `restore` lies when it is not in the job's own directory: a
    resumed run writes only steps after the one it resumed from, so that step is the
    earlier run's."""
    resume = config.resume
    if restore is None or resume is None or restore != resume.step:
        return None
    return resume.checkpoint_dir


def resume_point(record: GenerationRecord, reports: list[SyncReport]) -> tuple[int, Vote | None]:
    """The next step of g+1 and the vote of the step before it: the furthest step a live
    worker of g committed (workers that never joined g say nothing of it)."""
    joined = [r for r in reports if r.committed is not None]
    base = record.resume_step if record.restore_checkpoint is None else record.restore_checkpoint
    if not joined:
        return base, record.completed_vote if record.restore_checkpoint is None else None
    resume = max(r.committed for r in joined if r.committed is not None)
    vote = next((r.last_vote for r in joined
                 if r.committed == resume and r.last_vote is not None and r.last_vote.step == resume - 1), None)
    return resume, vote


# ---- hot spares (elastic/planning/spares.py) --------------------------------------------------


def ready_spares(s: Snapshot) -> list[int]:
    """Live nodes outside g whose workers have all registered, less a drained node's
    incarnation (never taken back in)."""
    gpus = s.record.plan.gpus_per_node
    ready = [n for n in sorted(s.registered) if s.registered[n] >= gpus]
    return [n for n in ready if (n, s.members[n]) not in s.drained]


def joining(s: Snapshot, config: ElasticConfig) -> tuple[list[int], list[int]]:
    """(ready newcomers that join at the next step boundary, the others, which stay spares).
    With hot spares configured, as many join as the plan lacks to reach the job's node count;
    without, every ready newcomer, as before spares existed."""
    ready = ready_spares(s)
    if config.spares == 0:
        return ready, []
    joined = newcomers_to_join(current=s.record.plan.nodes, ready=ready, active=config.cluster.nodes)
    return joined, [n for n in ready if n not in joined]


def spares_for_loss(s: Snapshot, config: ElasticConfig, lost: list[int]) -> list[int]:
    """The spares the re-plan that drops `lost` takes in (none when none is ready, and none
    without hot spares configured: a loss is then re-planned over the survivors, as before)."""
    if config.spares == 0:
        return []
    survivors = [n for n in s.record.plan.nodes if n not in lost]
    return spares_to_take(survivors=survivors, ready=ready_spares(s), active=config.cluster.nodes)


def spare_for_drain(s: Snapshot, config: ElasticConfig, node: int) -> int | None:
    """The spare that would take drained `node`'s stage: None when none is ready."""
    survivors = [n for n in s.record.plan.nodes if n != node]
    return next(iter(spares_to_take(survivors=survivors, ready=ready_spares(s), active=config.cluster.nodes)), None)


def drain_plan(tset: TemplateSet, s: Snapshot, config: ElasticConfig, node: int) -> tuple[Plan, str, int | None] | str:
    """The plan of g+1 without `node`, its reason and the spare taken in (if one is ready, it
    takes the node's stage at the planner's split: the job keeps its node count); or, as a
    string, why the drain cannot be met."""
    record = s.record
    spare = spare_for_drain(s, config, node)
    if spare is not None:
        split = planner_split(tset, record.plan) if record.balanced_for else record.plan
        return substitute(split, {node: spare}), f"drained node {node}: hot spare {spare} took its stage", spare
    others = sorted(n for n in record.plan.nodes if n != node)
    f = record.plan.fault_tolerance
    try:
        plan = replan(tset, record.plan, others, global_microbatches=record.plan.global_microbatches,
                      fault_tolerance=f).plan
    except PlanningError as exc:
        return (f"draining node {node} would leave nodes {node_list(others)}, which cannot "
                f"form the {f + 1} pipelines that fault tolerance {f} needs: {exc}")
    return plan, f"drained node {node}: re-planned over nodes {node_list(others)}", None
