"""The leader's decision table (elastic/roles/leader_decisions.py), one pure test per row: a
snapshot built by hand from real records (GenerationRecord, Plan, SyncReport, ...) in, the
round's writes out. No etcd, no processes. Each test checks what its case demands (the halt's
kind, who is lost or joins, which stage a spare takes, where training resumes), not a copy of
the code's output; tests/faults/test_leader.py runs the same cases through a real etcd."""

from __future__ import annotations

import dataclasses

from elastic.parallel.layout import assign_ranks
from elastic.parallel.shard_moves import moves_of
from elastic.planning.cluster import ClusterSpec, cluster_templates
from elastic.planning.stragglers import rebalanced
from elastic.records.config import ElasticConfig
from elastic.records.generation import GenerationRecord, HaltRecord, Vote
from elastic.records.injection_requests import InjectionRequest
from elastic.records.job import JobSpec
from elastic.records.progress import ProgressRecord
from elastic.records.stop import StopRequest
from elastic.records.stragglers import Mark, StragglerRecord
from elastic.records.sync import ABORT, COMMIT, SyncReport
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
from elastic.roles.leader_decisions import decide_round, halt_step
from elastic.roles.leader_replan import surviving_holders_cover
from elastic.roles.leader_snapshot import Snapshot
from elastic.transfer.shards import ShardKey
from templates.instantiation import instantiate
from templates.optim_slices import plan_owners, slice_moves
from templates.plan import Plan
from templates.template_set import TemplateSet

SPEC = ClusterSpec(model="tiny", nodes=5, fault_tolerance=1, global_batch=32, microbatch=2, device_memory_gib=0.03)
TSET = cluster_templates(dataclasses.replace(SPEC, fault_tolerance=0))  # a pipeline needs at least 2 nodes
PLAN = instantiate(TSET, [0, 1, 2, 3], global_microbatches=16, fault_tolerance=1)  # [(0, 1), (2, 3)], 8 + 8
PLAN5 = instantiate(TSET, [0, 1, 2, 3, 4], global_microbatches=16, fault_tolerance=1)
STEPS = 20
G = 3


def _config(plan: Plan = PLAN, *, spares: int = 0) -> ElasticConfig:
    spec = JobSpec(model="tiny", plan=plan, steps=STEPS, run_dir="/nonexistent", device="cpu")
    return ElasticConfig(spec=spec, cluster=dataclasses.replace(SPEC, nodes=len(plan.nodes)), spares=spares)


def _record(plan: Plan = PLAN, **kw: object) -> GenerationRecord:
    return GenerationRecord(plan=plan, resume_step=4, incarnations=dict.fromkeys(plan.nodes, 0), **kw)  # type: ignore[arg-type]


def _report(node: int, committed: int | None, *, vote_of: int | None = None, pending: int | None = None) -> SyncReport:
    vote = None if vote_of is None else Vote(step=vote_of, grad_norm=1.0 + vote_of, loss=2.0 + vote_of)
    return SyncReport(committed=committed, pending=pending, last_vote=vote, node=node, local_rank=0)


def _snapshot(record: GenerationRecord | None = None, *, members: dict[int, int] | None = None,
              **kw: object) -> Snapshot:
    record = record or _record()
    members = dict.fromkeys(record.plan.nodes, 0) if members is None else members
    return Snapshot(g=G, record=record, members=members, now=1000.0, **kw)  # type: ignore[arg-type]


def _decide(s: Snapshot, config: ElasticConfig | None = None) -> tuple[Step, ...]:
    return decide_round(s, config or _config(s.record.plan), TSET)


def _stage_of(plan: Plan, node: int) -> tuple[int, tuple[int, int]]:
    """(pipeline index, layer range) of `node`'s stage."""
    return next((i, st.layers) for i, p in enumerate(plan.pipelines) for st in p.stages if st.node == node)


def _holdings(plan: Plan, nodes: list[int]) -> dict[tuple[int, int], tuple[ShardKey, ...]]:
    """What `nodes` hold under `plan`: the layers of their stages."""
    return {(n, 0): tuple(ShardKey(layer, 0) for layer in range(*_stage_of(plan, n)[1])) for n in nodes}


def _drain(node: int, incarnation: int = 0) -> InjectionRequest:
    return InjectionRequest(id=f"drain-node{node}-now-abc", kind="drain", node=node, incarnation=incarnation)


# ---- lost --------------------------------------------------------------------------------------


def test_a_node_leaving_a_finished_or_stopped_job_is_no_loss() -> None:
    gone = {0: 0, 2: 0, 3: 0}
    stopped = HaltRecord(abort=False, reason="stop", at=1.0, stop_step=7)
    for s in (_snapshot(members=gone, last_step_decision=COMMIT), _snapshot(members=gone, halt=stopped)):
        steps = _decide(s)
        assert len(steps) == 1 and isinstance(steps[0], Finish), "no halt, no abort, no generation"


def test_a_loss_halts_with_abort_and_aborts_the_last_step() -> None:
    steps = _decide(_snapshot(members={0: 0, 2: 0, 3: 0}))
    assert steps == (Halt(abort=True, reason="lost node(s) [1]", lost=[1]), DecideLastStep(decision=ABORT))
    # Early in the step, the pipelines that lost no node stop too: the halt names no lost node.
    early = ProgressRecord(step=3, loss=1.0, grad_norm=1.0, lr=0.1, seconds=3.0, generation=G, committed_at=999.5)
    halt = _decide(_snapshot(members={0: 0, 2: 0, 3: 0}, progress=early))[0]
    assert isinstance(halt, Halt) and halt.abort and halt.lost == [] and "every pipeline stops" in halt.reason
    # A second loss rewrites an abort halt naming fewer nodes; the same loss does not.
    old = HaltRecord(abort=True, reason="lost node(s) [1]", at=1.0, lost=[1])
    assert _decide(_snapshot(members={0: 0, 2: 0}, halt=old))[0] == Halt(
        abort=True, reason="lost node(s) [1, 3]", lost=[1, 3], write=True)
    assert not halt_step(old, abort=True, reason="again", lost=[1]).write


def test_a_loss_with_every_report_resumes_at_the_furthest_committed_step_over_the_survivors() -> None:
    survivors = [0, 2, 3]
    halt = HaltRecord(abort=True, reason="lost node(s) [1]", at=1.0, lost=[1])
    reports = [_report(0, 5, vote_of=4), _report(2, 4, pending=4, vote_of=3), _report(3, 5, vote_of=4)]
    steps = _decide(_snapshot(members=dict.fromkeys(survivors, 0), halt=halt, reports=reports,
                              holdings=_holdings(PLAN, survivors)))
    assert steps[:2] == (Halt(abort=True, reason="lost node(s) [1]", lost=[1], write=False),
                         DecideLastStep(decision=ABORT))
    assert len(steps) == 3 and isinstance(steps[2], Publish)
    new = steps[2].record
    assert new.lost == [1] and new.joined == [] and new.resume_step == 5 and new.restore_checkpoint is None
    assert new.completed_vote == Vote(step=4, grad_norm=5.0, loss=6.0), "node 2 completes step 4 with node 0's vote"
    assert sorted(new.plan.nodes) == survivors and surviving_holders_cover(new.plan, set(survivors))
    # 3 nodes cannot form 2 pipelines of 2 nodes: f is relaxed to 0, and only that far.
    assert new.plan.fault_tolerance == 0 and "fault tolerance relaxed from 1 to 0" in new.reason
    assert new.incarnations == dict.fromkeys(survivors, 0)


def test_a_loss_publishes_the_moves_that_give_every_rank_its_stage_and_none_for_the_grpc_path() -> None:
    """The leader plans the collective shard path once, into the record (no worker reads the
    holder map): after the moves, every worker of the new plan holds its stage."""
    survivors = [0, 1, 3]  # node 1 (layers 3-6 before) takes layer 2, from node 0
    reports = [_report(n, 5, vote_of=4) for n in survivors]
    s = _snapshot(members=dict.fromkeys(survivors, 0), reports=reports, holdings=_holdings(PLAN, survivors))
    publish = _decide(s)[-1]
    assert isinstance(publish, Publish) and publish.record.moves is not None
    new = publish.record.plan
    held = {w.rank: set(_holdings(PLAN, survivors).get((w.node, w.local_rank), ())) for w in assign_ranks(new)}
    moves = moves_of(publish.record.moves, new)
    assert moves, "node 1 lacks layer 2"
    for m in moves:
        assert m.key in held[m.src] and m.key not in held[m.dst], m
        held[m.dst].add(m.key)
    assert all(held[w.rank] >= set(_holdings(new, [w.node])[(w.node, 0)]) for w in assign_ranks(new))
    grpc = _config()
    grpc = dataclasses.replace(grpc, spec=dataclasses.replace(grpc.spec, shard_transport="grpc"))
    publish = _decide(s, grpc)[-1]
    assert isinstance(publish, Publish) and publish.record.moves is None


def test_a_loss_while_a_spare_is_ready_puts_the_spare_in_the_lost_stage() -> None:
    members = {0: 0, 2: 0, 3: 0, 4: 0}
    reports = [_report(n, 5, vote_of=4) for n in (0, 2, 3)]
    steps = _decide(_snapshot(members=members, reports=reports, registered={4: 1},
                              holdings=_holdings(PLAN, [0, 2, 3])), _config(spares=1))
    assert isinstance(steps[0], Halt) and steps[0].abort and steps[1] == DecideLastStep(decision=ABORT)
    assert steps[2] == SpareTaken(node=4, incarnation=0, lost=[1], generation=G + 1)
    assert isinstance(steps[3], Publish) and len(steps) == 4
    new = steps[3].record
    assert new.lost == [1] and new.joined == [4] and new.resume_step == 5
    assert _stage_of(new.plan, 4) == _stage_of(PLAN, 1), "the spare takes the lost node's stage"
    assert all(_stage_of(new.plan, n) == _stage_of(PLAN, n) for n in (0, 2, 3)), "the same instantiation"
    assert new.plan.fault_tolerance == 1 and new.incarnations == {0: 0, 2: 0, 3: 0, 4: 0}


def test_a_layer_without_a_live_holder_falls_back_to_a_checkpoint() -> None:
    # Nodes 0 and 2 are the first stages of both pipelines: layers 0-2 lose every holder.
    members = {1: 0, 3: 0}
    reports = [_report(1, 7, vote_of=6), _report(3, 7, vote_of=6)]
    steps = _decide(_snapshot(members=members, reports=reports, holdings=_holdings(PLAN, [1, 3])))
    assert isinstance(steps[0], Halt) and steps[0].lost == [0, 2] and steps[1] == DecideLastStep(decision=ABORT)
    assert len(steps) == 3 and isinstance(steps[2], PublishFallback)
    fallback = steps[2]
    assert fallback.fallback.live == [1, 3] and fallback.lost == [0, 2] and fallback.joined == []
    assert fallback.fallback.gaps == [ShardKey(layer, 0) for layer in range(3)]


SPEC6 = dataclasses.replace(SPEC, nodes=6, global_batch=24, device_memory_gib=8)
PLAN6 = instantiate(cluster_templates(dataclasses.replace(SPEC6, fault_tolerance=0)), list(range(6)),
                    global_microbatches=12, fault_tolerance=1)  # six one-node pipelines: 3 slices of 2 owners


def _sharded(plan: Plan) -> tuple[ElasticConfig, TemplateSet]:
    config = _config(plan)
    spec = dataclasses.replace(config.spec, shard_optimizer="on")
    cluster = dataclasses.replace(SPEC6, nodes=len(plan.nodes))
    return (dataclasses.replace(config, spec=spec, cluster=cluster),
            cluster_templates(dataclasses.replace(cluster, fault_tolerance=0)))


def test_a_sharded_loss_keeps_every_surviving_owner_on_its_slice_and_records_it() -> None:
    """Node 0 lost of 6 one-node pipelines: 3 slices become 2. The record carries owners under
    which the survivors lack fewer elements than under the new plan's own (node 0 owned slice 1,
    so the plan's own would shift every survivor), and every slice keeps f + 1 owners."""
    survivors = [1, 2, 3, 4, 5]
    config, tset = _sharded(PLAN6)
    reports = [_report(n, 5, vote_of=4) for n in survivors]
    steps = decide_round(_snapshot(_record(PLAN6), members=dict.fromkeys(survivors, 0), reports=reports,
                                   holdings=_holdings(PLAN6, survivors)), config, tset)
    publish = steps[-1]
    assert isinstance(publish, Publish) and publish.record.slice_owners is not None
    new = publish.record
    assert sorted(new.plan.nodes) == survivors and len(new.plan.pipelines) == 5
    before, after, own = plan_owners(PLAN6), new.owners(), plan_owners(new.plan)
    assert after != own
    sizes = [1 << 20]
    lacked = {name: sum(m.stop - m.start for layer in range(PLAN6.num_layers)
                        for m in slice_moves(before[layer], owned[layer], sizes=sizes, live=survivors))
              for name, owned in (("recorded", after), ("plan's own", own))}
    assert lacked["recorded"] < lacked["plan's own"], lacked
    assert all(len(nodes) >= 2 for o in after.values() for nodes in o.owners)
    unsharded = decide_round(_snapshot(_record(PLAN6), members=dict.fromkeys(survivors, 0), reports=reports,
                                       holdings=_holdings(PLAN6, survivors)), _config(PLAN6), tset)
    assert isinstance(unsharded[-1], Publish) and unsharded[-1].record.slice_owners is None


def test_a_sharded_loss_of_every_owner_the_record_names_falls_back() -> None:
    """The record's owners decide which slice is lost, not the plan's own: nodes 0 and 1 own
    slice 1 together only under the recorded owners."""
    survivors = [2, 3, 4, 5]
    config, tset = _sharded(PLAN6)
    rows = [[[0, 1], [2, 3], [4, 5]] for _ in range(PLAN6.num_layers)]
    reports = [_report(n, 5, vote_of=4) for n in survivors]
    for record, lost_slice in ((_record(PLAN6, slice_owners=rows), True), (_record(PLAN6), False)):
        steps = decide_round(_snapshot(record, members=dict.fromkeys(survivors, 0), reports=reports,
                                       holdings=_holdings(PLAN6, survivors)), config, tset)
        assert isinstance(steps[-1], PublishFallback if lost_slice else Publish), steps[-1]
        if isinstance(steps[-1], PublishFallback):
            assert "layer 0, optimizer slice 1 of 3: every owner lost (nodes 0, 1)" in (steps[-1].fallback.cause or "")


def _having(node: int, lo: int, hi: int, total: int = 3000) -> SyncReport:
    """Node `node`'s report when it has the moments of elements [lo, hi) of every layer (of `total`)."""
    spans = [(layer, 0, lo, hi, total) for layer in range(PLAN6.num_layers)]
    return dataclasses.replace(_report(node, 5, vote_of=4), moments=spans)


def test_a_sharded_loss_is_judged_by_the_moments_the_survivors_report() -> None:
    """Generation g's record gives slice 1 to {0, 1}, but g was superseded before its repair: the
    survivors report what they still have (the slices of the generation before). Node 0's loss
    leaves elements [0, 1000) with no live worker although the record names node 1 their owner:
    a fallback that names the elements (issue 55's race: the plan alone planned, and the workers'
    repair found the loss and hung). Conversely, a slice whose recorded owners are all lost is
    no loss while a survivor reports its elements (their old owner, not yet moved off them)."""
    survivors = [1, 2, 3, 4, 5]
    config, tset = _sharded(PLAN6)
    rows = [[[0, 1], [2, 3], [4, 5]] for _ in range(PLAN6.num_layers)]
    cut_short = [_having(1, 2000, 3000), _having(2, 1000, 2000), _having(3, 1000, 2000),
                 _having(4, 2000, 3000), _having(5, 2000, 3000)]
    steps = decide_round(_snapshot(_record(PLAN6, slice_owners=rows), members=dict.fromkeys(survivors, 0),
                                   reports=cut_short, holdings=_holdings(PLAN6, survivors)), config, tset)
    assert isinstance(steps[-1], PublishFallback), steps[-1]
    cause = steps[-1].fallback.cause or ""
    assert cause.startswith("layer 0, optimizer elements [0, 1000) of tensor-parallel rank 0: no live worker"), cause
    assert f"(and {PLAN6.num_layers - 1} more)" in cause

    survivors = [2, 3, 4, 5]
    still_held = [_having(2, 0, 1000), _having(3, 1000, 2000), _having(4, 2000, 3000), _having(5, 2000, 3000)]
    steps = decide_round(_snapshot(_record(PLAN6, slice_owners=rows), members=dict.fromkeys(survivors, 0),
                                   reports=still_held, holdings=_holdings(PLAN6, survivors)), config, tset)
    assert isinstance(steps[-1], Publish), steps[-1]
    reports = [_report(n, 5, vote_of=4) for n in survivors]  # no moments reported: the record decides
    steps = decide_round(_snapshot(_record(PLAN6, slice_owners=rows), members=dict.fromkeys(survivors, 0),
                                   reports=reports, holdings=_holdings(PLAN6, survivors)), config, tset)
    assert isinstance(steps[-1], PublishFallback), steps[-1]


def test_a_loss_after_every_survivor_committed_the_last_step_finishes() -> None:
    reports = [_report(n, STEPS, vote_of=STEPS - 1) for n in (0, 2, 3)]
    steps = _decide(_snapshot(members={0: 0, 2: 0, 3: 0}, reports=reports, holdings=_holdings(PLAN, [0, 2, 3])))
    assert [type(s) for s in steps] == [Halt, DecideLastStep, Finish], "nothing is left to publish"


# ---- the last step, the stop -------------------------------------------------------------------


def test_the_last_step_is_committed_once_every_rank_is_ready() -> None:
    assert _decide(_snapshot(last_step_ready=3)) == (), "three of four ranks ready decide nothing"
    assert _decide(_snapshot(last_step_ready=4)) == (DecideLastStep(decision=COMMIT),)


def test_a_stop_request_halts_at_the_next_step_boundary() -> None:
    stop = StopRequest(by="sigint", requested_at=1.0)
    steps = _decide(_snapshot(stop=stop))
    assert len(steps) == 1 and isinstance(steps[0], Halt) and not steps[0].abort and steps[0].write
    assert steps[0].reason == f"stop of the whole job ({stop.words()}) at the next step boundary"


def test_a_stop_names_the_step_every_worker_committed() -> None:
    stop = StopRequest(by="cli", requested_at=1.0)
    halt = HaltRecord(abort=False, reason="stop", at=1.0)
    steps = _decide(_snapshot(stop=stop, halt=halt, reports=[_report(n, 7, vote_of=6) for n in range(4)]))
    assert len(steps) == 2 and isinstance(steps[0], Halt) and not steps[0].write
    assert steps[1] == StopAt(step=7, by="cli", words=stop.words())


def test_a_stop_settles_a_cut_short_vote_in_a_generation_first() -> None:
    stop = StopRequest(by="cli", requested_at=1.0)
    reports = [_report(n, 7, vote_of=6) for n in (0, 1, 3)] + [_report(2, 6, pending=6, vote_of=5)]
    steps = _decide(_snapshot(stop=stop, reports=sorted(reports, key=lambda r: r.node), holdings=_holdings(PLAN, [0, 1, 2, 3])))
    assert len(steps) == 2 and isinstance(steps[1], Publish)
    new = steps[1].record
    assert new.resume_step == 7 and new.completed_vote is not None and new.completed_vote.step == 6
    assert sorted(new.plan.nodes) == [0, 1, 2, 3] and new.lost == new.joined == []


# ---- spares and joins --------------------------------------------------------------------------


def test_a_ready_newcomer_beyond_the_node_count_is_a_spare_said_once() -> None:
    members = {0: 0, 1: 0, 2: 0, 3: 0, 4: 2}
    steps = _decide(_snapshot(members=members, registered={4: 1}), _config(spares=1))
    assert steps == (NoteSpare(node=4, incarnation=2, generation=G),), "a spare, not a join: no halt"
    assert _decide(_snapshot(members=members, registered={4: 1}, spares_noted=frozenset({(4, 2)})),
                   _config(spares=1)) == ()
    assert _decide(_snapshot(members=members, registered={4: 0}), _config(spares=1)) == (), "not ready yet"


def test_a_ready_newcomer_joins_at_a_step_boundary() -> None:
    members = {0: 0, 1: 0, 2: 0, 3: 0, 4: 0}
    steps = _decide(_snapshot(members=members, registered={4: 1}))
    assert steps == (Halt(abort=False, reason="node(s) [4] joining"),), "a join never throws away a step"
    reports = [_report(n, 3, vote_of=2) for n in range(4)]
    steps = _decide(_snapshot(members=members, registered={4: 1}, reports=reports,
                              holdings=_holdings(PLAN, [0, 1, 2, 3])))
    assert len(steps) == 2 and isinstance(steps[1], Publish)
    new = steps[1].record
    assert new.joined == [4] and 4 in new.plan.nodes and new.resume_step == 3 and new.lost == []
    assert len(new.plan.pipelines) >= 2 and new.incarnations[4] == 0
    # A drained node's incarnation is never taken back in.
    assert _decide(_snapshot(members=members, registered={4: 1}, drained=frozenset({(4, 0)}))) == ()


# ---- drains ------------------------------------------------------------------------------------


def test_a_drain_of_a_node_not_in_the_generation_is_refused() -> None:
    req = _drain(1, incarnation=5)
    steps = _decide(_snapshot(drain_requests=[req]))
    assert len(steps) == 1 and isinstance(steps[0], Answer) and steps[0].request == req
    assert steps[0].state == "refused" and f"is not in generation {G}" in steps[0].detail


def test_a_drain_the_others_can_meet_halts_at_a_boundary_then_publishes_without_the_node() -> None:
    record = _record(PLAN5)
    req = _drain(4)
    steps = _decide(_snapshot(record, drain_requests=[req]))
    assert steps == (Halt(abort=False, reason="drain of node 4"),)
    reports = [_report(n, 9, vote_of=8) for n in range(5)]
    steps = _decide(_snapshot(record, drain_requests=[req], halt=HaltRecord(abort=False, reason="x", at=1.0),
                              reports=reports, holdings=_holdings(PLAN5, list(range(5)))))
    assert [type(s) for s in steps] == [Halt, Publish, Answer]
    new = steps[1].record  # type: ignore[union-attr]
    assert sorted(new.plan.nodes) == [0, 1, 2, 3] and new.drained == [4] and new.lost == [] and new.resume_step == 9
    assert len(new.plan.pipelines) == 2, "the job keeps its f + 1 pipelines"
    assert steps[2] == Answer(request=req, state="done", detail=new.reason, generation=G + 1)


def test_a_drain_with_a_ready_spare_puts_the_spare_in_its_stage() -> None:
    members = {0: 0, 1: 0, 2: 0, 3: 0, 4: 0}
    req = _drain(3)
    reports = [_report(n, 9, vote_of=8) for n in range(4)]
    steps = _decide(_snapshot(members=members, registered={4: 1}, drain_requests=[req], reports=reports,
                              holdings=_holdings(PLAN, [0, 1, 2, 3])), _config(spares=1))
    assert [type(s) for s in steps] == [NoteSpare, Halt, SpareTaken, Publish, Answer]
    assert steps[2] == SpareTaken(node=4, incarnation=0, lost=[], drained=[3], generation=G + 1)
    new = steps[3].record  # type: ignore[union-attr]
    assert _stage_of(new.plan, 4) == _stage_of(PLAN, 3) and 3 not in new.plan.nodes and new.joined == [4]
    assert isinstance(steps[4], Answer) and steps[4].state == "done" and "hot spare 4 took its stage" in steps[4].detail


def test_a_drain_the_others_cannot_meet_is_refused_with_its_reason() -> None:
    req = _drain(3)
    steps = _decide(_snapshot(drain_requests=[req]))
    assert len(steps) == 1 and isinstance(steps[0], Answer) and steps[0].state == "refused"
    assert "cannot form the 2 pipelines that fault tolerance 1 needs" in steps[0].detail


def test_a_drain_met_after_the_job_finished_is_refused() -> None:
    record = _record(PLAN5)
    req = _drain(4)
    reports = [_report(n, STEPS, vote_of=STEPS - 1) for n in range(5)]
    steps = _decide(_snapshot(record, drain_requests=[req], reports=reports, holdings={}))
    assert [type(s) for s in steps] == [Halt, Finish, Answer]
    assert steps[2] == Answer(request=req, state="refused", detail="the job finished before a step boundary came")


# ---- stragglers --------------------------------------------------------------------------------

SLOW = {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.2}
MARK = {3: Mark(since_step=40, since=0.0, factor=2.0)}


def _speeds() -> StragglerRecord:
    return StragglerRecord(step=60, generation=G, at=0.0, policy="x", threshold=1.25,
                           factors={n: (2.0 if n in MARK else 1.0) for n in range(4)}, busy=SLOW, marked=MARK)


def test_a_straggler_under_rebalance_gets_a_new_split_at_a_boundary() -> None:
    steps = _decide(_snapshot(straggler_policy="rebalance", stragglers=_speeds()))
    assert steps == (Halt(abort=False, reason="a rebalance for stragglers"),)
    reports = [_report(n, 12, vote_of=11) for n in range(4)]
    steps = _decide(_snapshot(straggler_policy="rebalance", stragglers=_speeds(), reports=reports, holdings={}))
    assert len(steps) == 2 and isinstance(steps[1], Publish)
    new = steps[1].record
    assert new.plan == rebalanced(PLAN, {n: b / 8 for n, b in SLOW.items()}).plan and new.balanced_for == [3]
    slow_pipe = _stage_of(PLAN, 3)[0]
    assert new.plan.pipelines[slow_pipe].microbatches < 8, "microbatches move away from the straggler"
    assert new.plan.nodes == PLAN.nodes and new.resume_step == 12
    assert _decide(_snapshot(straggler_policy="rebalance", stragglers_unreadable=True)) == ()


def test_a_straggler_under_auto_with_a_ready_spare_asks_for_its_drain_once() -> None:
    members = {0: 0, 1: 0, 2: 0, 3: 0, 4: 0}
    s = _snapshot(members=members, registered={4: 1}, straggler_policy="auto", stragglers=_speeds(),
                  spares_noted=frozenset({(4, 0)}))
    steps = _decide(s, _config(spares=1))
    assert len(steps) == 1 and isinstance(steps[0], AskDrain)
    assert (steps[0].node, steps[0].incarnation, steps[0].choice, steps[0].factor) == (3, 0, "spare", 2.0)
    assert _decide(dataclasses.replace(s, drains_asked=frozenset({(3, 0)})), _config(spares=1)) == ()


def test_nothing_to_do_writes_nothing() -> None:
    assert _decide(_snapshot()) == ()
    assert _decide(_snapshot(straggler_policy="rebalance", stragglers=None)) == ()


def test_refused_drains_leave_the_round_to_the_stragglers() -> None:
    steps = _decide(_snapshot(drain_requests=[_drain(3)], straggler_policy="rebalance", stragglers=_speeds()))
    assert [type(s) for s in steps] == [Answer, Halt] and isinstance(steps[0], Answer)
    assert steps[0].state == "refused" and steps[1] == Halt(abort=False, reason="a rebalance for stragglers")
