"""The leader's decisions: pure functions from one round's snapshot (roles/leader_snapshot.py:
the generation record g, live members, sync reports, requests) to the writes of the round
(roles/leader_actions.py), in order. No etcd, no clock, no files: roles/leader.py reads the
snapshot and carries the writes out; tests/roles/test_leader_decisions.py tests each row below.

The leader keeps nothing that etcd does not have: a newly elected leader reads the current
generation, its halt and the sync reports written so far, and goes on from there. Steps commit
without it (every worker commits when the step's vote completes: see elastic/records/sync.py); it acts only
when membership changes. "Reports" below: every live worker of g has written its sync report.

| case (first that applies) | writes, in order |
| --- | --- |
| lost: a node of g is gone, but the last step committed or g's halt carries the job's stop | Finish (nodes leave a done job: no loss) |
| lost | Halt(abort, lost nodes when the step is worth finishing, partial.worth_finishing); DecideLastStep(abort) (the job is done if "commit" won) |
| lost, reports | ... then SpareTaken for each ready spare taking a lost node's stage; Publish g+1 (spares in the lost stages, else re-planned over the live nodes, f relaxed only as far as needed) |
| lost, reports, a layer without a live holder or no plan fits | ... PublishFallback: a plan from scratch, every worker restores the newest verified checkpoint |
| lost, reports, the furthest committed step is the job's last | ... Finish |
| every rank of g ready for the job's last step | DecideLastStep(commit) (the only step decided here), then the rows below |
| stop asked (elastic/records/stop.py) | Halt(boundary) |
| stop, reports, all committed the same step S, none pending | StopAt(S): each worker checkpoints S and leaves |
| stop, reports, a vote cut short | Publish g+1 over the same nodes first; the stop is met at its first boundary |
| ready newcomers beyond the job's node count (hot spares) | NoteSpare (once per incarnation), then the rows below |
| join: a ready newcomer (all its workers registered) | Halt(boundary), then with reports Publish g+1 with it |
| drain request of a node not in g | Answer(refused) |
| drain request that f+1 pipelines (or a ready spare) can meet | Halt(boundary); with reports SpareTaken, Publish g+1 without it, Answer(done) (refused when the job finished first) |
| drain request the others cannot meet | Answer(refused), with the reason |
| straggler, a re-split estimated >= 10 % faster, or a split no longer needed | Halt(boundary); with reports Publish g+1: same nodes, new split (roles/straggler_decisions.py) |
| straggler under `auto`, a spare or a drop estimated cheaper | AskDrain (once per incarnation): the drain rows above carry it out |
| nothing of the above | nothing |

A join or a drain never throws away a step's work: the boundary halt is voted into the step in
flight (each worker reads it right before its vote) and g+1 starts after that step. A drained
node's incarnation is never taken back in. Keys of generations before g are deleted when g+1 is
published, so etcd holds O(workers) of them.
"""

from __future__ import annotations

from elastic.parallel.layout import assign_ranks
from elastic.parallel.shard_moves import move_rows, plan_moves, ranked_holdings
from elastic.planning.stragglers import ACTING
from elastic.records.config import ElasticConfig
from elastic.records.generation import GenerationRecord, HaltRecord
from elastic.records.partial import resolve_replay, worth_finishing
from elastic.records.sync import ABORT, COMMIT
from elastic.roles.leader_actions import (
    Answer,
    AskDrain,
    DecideLastStep,
    Finish,
    Halt,
    NoteSpare,
    Publish,
    PublishFallback,
    SpareTaken,
    Step,
    StopAt,
)
from elastic.roles.leader_replan import (
    Fallback,
    drain_plan,
    joining,
    replan_after,
    resume_point,
    spare_for_drain,
    spares_for_loss,
)
from elastic.roles.leader_snapshot import Snapshot
from elastic.roles.straggler_decisions import DrainStraggler, Resplit, straggler_decision
from templates.optim_slices import owner_rows, plan_owners
from templates.plan import Plan
from templates.template_set import TemplateSet

REBALANCE_GAIN = 0.1
"""Least estimated step-time gain (a fraction) for which the leader acts on stragglers
(`--straggler-policy rebalance` or `auto`)."""


def decide_round(s: Snapshot, config: ElasticConfig, tset: TemplateSet) -> tuple[Step, ...]:
    """The writes of this round, in order (the module doc's table, row by row)."""
    if s.lost:
        return on_loss(s, config, tset)
    world = len(s.record.plan.nodes) * s.record.plan.gpus_per_node
    first: tuple[Step, ...] = (DecideLastStep(decision=COMMIT),) if s.last_step_ready >= world else ()
    if s.stop is not None:
        return (*first, *on_stop(s, config, tset))
    return (*first, *on_boundary(s, config, tset))


def halt_step(old: HaltRecord | None, *, abort: bool, reason: str, lost: list[int] | None = None) -> Halt:
    """A halt, written unless one at least as strong is there. An abort naming lost nodes is
    rewritten when more are lost (their pipelines must stop too); one naming none stops all."""
    write = old is None or (abort and not (old.abort and (not old.lost or (lost and set(lost) <= set(old.lost)))))
    return Halt(abort=abort, reason=reason, lost=sorted(lost or []), write=bool(write))


def on_loss(s: Snapshot, config: ElasticConfig, tset: TemplateSet) -> tuple[Step, ...]:
    """A node of g is gone: halt with abort, abort the last step, and once every live worker
    reported, publish g+1 (ready spares in the lost stages, a re-plan or a fallback)."""
    lost = s.lost
    if s.last_step_decision == COMMIT or (s.halt is not None and s.halt.stop_step is not None):
        return (Finish(why="nodes leave once the job is done (or stopped): not a loss"),)
    finish = config.spec.partial_replay and (
        s.progress is None or worth_finishing(s.now - s.progress.committed_at, s.progress.seconds))
    reason = f"lost node(s) {lost}" + ("" if finish else ", early in the step: every pipeline stops")
    steps: list[Step] = [halt_step(s.halt, abort=True, reason=reason, lost=lost if finish else []),
                         DecideLastStep(decision=ABORT)]
    if s.reports is None:
        return tuple(steps)
    taken = spares_for_loss(s, config, lost)
    steps += [SpareTaken(node=n, incarnation=s.members[n], lost=lost, generation=s.g + 1) for n in taken]
    return (*steps, *next_generation(s, config, tset, lost=lost, joined=taken))


def on_stop(s: Snapshot, config: ElasticConfig, tset: TemplateSet) -> tuple[Step, ...]:
    """The job's stop: halt at the boundary; once every live worker reported the same committed
    step S (none pending), StopAt(S); a cut-short vote is settled in a generation of its own first."""
    assert s.stop is not None
    halt = halt_step(s.halt, abort=False, reason=f"stop of the whole job ({s.stop.words()}) at the next step boundary")
    if s.reports is None:
        return (halt,)
    committed = {r.committed for r in s.reports}
    if len(committed) != 1 or None in committed or any(r.pending is not None for r in s.reports):
        return (halt, *next_generation(s, config, tset, lost=[], joined=[]))
    step = committed.pop()
    assert step is not None
    return (halt, StopAt(step=step, by=s.stop.by, words=s.stop.words()))


def on_boundary(s: Snapshot, config: ElasticConfig, tset: TemplateSet) -> tuple[Step, ...]:
    """Joins, then drains, then stragglers: the first that applies halts g at the next step
    boundary and publishes g+1 once every live worker reported."""
    joined, spares = joining(s, config)
    steps: list[Step] = [NoteSpare(node=n, incarnation=s.members[n], generation=s.g)
                         for n in spares if (n, s.members[n]) not in s.spares_noted]
    if joined:
        halt = halt_step(s.halt, abort=False, reason=f"node(s) {joined} joining")
        if s.reports is None:
            return (*steps, halt)
        return (*steps, halt, *next_generation(s, config, tset, lost=[], joined=joined))
    refused, drain = on_drain(s, config, tset)
    steps += refused
    if drain is not None:
        return (*steps, *drain)
    balance = on_stragglers(s, config, tset)
    if balance is None:
        return tuple(steps)
    if isinstance(balance, AskDrain):
        return (*steps, balance)
    halt = halt_step(s.halt, abort=False, reason="a rebalance for stragglers")
    if s.reports is None:
        return (*steps, halt)
    return (*steps, halt, *next_generation(s, config, tset, lost=[], joined=[], planned=(balance.plan, balance.reason),
                                           balanced_for=balance.balanced_for))


def on_drain(s: Snapshot, config: ElasticConfig, tset: TemplateSet) -> tuple[list[Answer], tuple[Step, ...] | None]:
    """The pending drain requests, in order: (the refusals of those that cannot be met, the
    writes of the first that can, or None when none can)."""
    refused: list[Answer] = []
    for req in s.drain_requests:
        if req.node not in s.record.plan.nodes or s.record.incarnations.get(req.node) != req.incarnation:
            refused.append(Answer(request=req, state="refused", detail=(
                f"node {req.node} (incarnation {req.incarnation}) is not in generation {s.g} "
                f"(nodes {sorted(s.record.plan.nodes)})")))
            continue
        planned = drain_plan(tset, s, config, req.node)
        if isinstance(planned, str):
            refused.append(Answer(request=req, state="refused", detail=planned))
            continue
        plan, reason, spare = planned
        halt = halt_step(s.halt, abort=False, reason=f"drain of node {req.node}")
        if s.reports is None:
            return refused, (halt,)
        taken = [] if spare is None else [spare]
        spares = [SpareTaken(node=n, incarnation=s.members[n], lost=[], drained=[req.node], generation=s.g + 1)
                  for n in taken]
        after = next_generation(s, config, tset, lost=[], joined=taken, drained=[req.node], planned=(plan, reason))
        answer = (Answer(request=req, state="done", detail=reason, generation=s.g + 1)
                  if isinstance(after[-1], Publish)
                  else Answer(request=req, state="refused", detail="the job finished before a step boundary came"))
        return refused, (halt, *spares, *after, answer)
    return refused, None


def on_stragglers(s: Snapshot, config: ElasticConfig, tset: TemplateSet) -> Resplit | AskDrain | None:
    """A re-split for stragglers to publish, a straggler's drain to ask for (under `auto`, once
    per incarnation), or None (roles/straggler_decisions.py)."""
    policy = s.straggler_policy
    if (policy not in ACTING and not s.record.balanced_for) or s.stragglers_unreadable:
        return None
    decision = straggler_decision(policy=policy, g=s.g, record=s.record, speeds=s.stragglers, tset=tset,
                                  gain=REBALANCE_GAIN, spare_for=lambda node: spare_for_drain(s, config, node))
    if not isinstance(decision, DrainStraggler):
        return decision
    incarnation = s.record.incarnations[decision.node]
    if (decision.node, incarnation) in s.drains_asked:
        return None
    return AskDrain(node=decision.node, incarnation=incarnation, choice=decision.choice, factor=decision.factor,
                    estimates=decision.estimates)


def next_generation(s: Snapshot, config: ElasticConfig, tset: TemplateSet, *, lost: list[int], joined: list[int],
                    drained: list[int] | None = None, planned: tuple[Plan, str] | None = None,
                    balanced_for: list[int] | None = None) -> tuple[Step, ...]:
    """Publish g+1 (or Finish: the furthest committed step is past the job's last). `planned`:
    its plan and reason; without, the live nodes are re-planned (leader_replan.replan_after)."""
    assert s.reports is not None
    resume, vote = resume_point(s.record, s.reports)
    if resume >= config.spec.steps:
        return (Finish(why="the job's last step was committed first"),)
    current = s.record.owners() if config.spec.sharded_optimizer else None  # the slice owners under g
    if planned is None:
        live = sorted(n for n, inc in s.members.items() if s.record.incarnations.get(n) == inc or n in joined)
        moments = None if current is None else [r.moments for r in s.reports if r.node in live]
        got = replan_after(tset, s.record.plan, live, s.holdings or {}, lost=lost, joined=joined, owners=current,
                           moments=moments)
        if isinstance(got, Fallback):
            return (PublishFallback(fallback=got, members=dict(s.members), lost=lost, joined=joined),)
        planned = got
    plan, reason = planned
    replay = None
    if lost:
        replay = resolve_replay(plan, [(r.node, r.local_rank, r.partial) for r in s.reports], step=resume)
    moves = None
    if config.spec.shard_transport == "collective":  # planned here once, not by every worker
        workers = assign_ranks(plan)
        moves = move_rows(plan_moves(plan, ranked_holdings(plan, s.holdings or {}, workers=workers), workers=workers))
    # sharded: each surviving owner kept on its slice, so that few moments move
    owners = None if current is None else owner_rows(plan_owners(plan, previous=current))
    return (Publish(record=GenerationRecord(
        plan=plan, resume_step=resume, incarnations={n: s.members[n] for n in plan.nodes}, lost=lost,
        joined=joined, drained=drained or [], reason=reason, completed_vote=vote, replay=replay,
        balanced_for=balanced_for or [], moves=moves, slice_owners=owners)),)
