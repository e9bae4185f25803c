"""The leader: failure handling, joins, drains and re-planning, inside the elected agent.

It keeps nothing that etcd does not have: a newly elected leader reads the current generation,
its halt and the sync reports written so far, and goes on from there. Steps commit without it
(every worker commits when the step's vote, a world all-reduce, completes: see elastic/records/sync.py);
it acts only when membership changes. Each round (woken by a change under members/, workers/,
sync/, ready/ or injections/, or every second) reads O(nodes) keys and never a per-step key:

- a member of the current generation g is gone (lease revoked or expired): `halt/<g>` is
  written with abort (every worker abandons its in-flight step unless that step's vote
  completed), the job's last step is decided "abort" unless "commit" won (then the job is
  done), and once every live worker of g has written its sync report, the resume step is the
  furthest step a live worker committed; a survivor whose vote of the step before was cut short
  completes it with the vote another survivor saw (`completed_vote`). The live nodes are
  re-planned on the precomputed templates and generation g+1 is published (fenced: only the
  leader can). If a layer has no surviving holder, or the survivors cannot form f+1 pipelines,
  the plan is rebuilt from scratch over the live nodes, relaxing f only as far as needed, and
  every worker restores the latest complete checkpoint;
- every rank of g is ready for the job's last step: "commit" (the only step decided here);
- a new node (a node id absent from the plan, or a new incarnation) has registered all its
  workers, or a drain request (`elastic drain`, injections/) can be met: `halt/<g>` is written
  without abort, the workers vote it into their next step and all stop after committing that
  step, and g+1 takes the node in (or leaves the drained node out) from the step after it: a
  join or a drain never throws away a step's work. A drain is refused (with its reason in the
  request's status and an event) unless the other nodes can still form the job's f+1
  pipelines, or a ready hot spare takes its stage; a drained node's workers serve their shards
  until g+1 has committed a step, then leave. A drained node's incarnation is never taken back in
  (a rejoin brings a new incarnation);
- under `--straggler-policy rebalance` or `auto` (or the operator's change, `elastic stragglers`),
  a node is marked as a straggler (the `stragglers` key, elastic/planning/stragglers.py) and a
  re-split of the global microbatches for the measured stage times is estimated at least 10 %
  faster, or no mark is left and the split is not the planner's (roles/straggler_decisions.py):
  `halt/<g>` is written without abort and g+1 has the same nodes, stages and layers with the new
  split (`balanced_for`: the marked nodes); its reason has the estimated step times. Under `auto`,
  when a spare in the straggler's stage or dropping it is estimated cheaper still, the leader asks
  for the straggler's drain (a request `by` "stragglers", once per incarnation, and a
  "straggler-action" event with every estimate) and the drain is carried out as above;
- the job's stop was asked (`stop`, elastic/records/stop.py: `elastic run`'s first Ctrl-C or
  SIGTERM, `elastic drain --all`): `halt/<g>` is written without abort, and once every live
  worker reported the same committed steps S it is rewritten with `stop_step` S (a "stopped"
  event): each worker checkpoints step S and leaves, and no generation follows. Nodes leaving a
  stopped generation are no loss, for this leader or one elected after it.

Hot spares (`elastic run --spares K`, elastic/planning/spares.py): live nodes beyond the job's
node count (`cluster.nodes`) whose workers have registered wait outside every generation. The
re-plan that drops a lost node, or a drained one, puts a ready spare into its stage in the same
generation g+1 (the same instantiation; the spare fetches the stage's shards like any node that
gains layers); a newcomer joins only while the plan is short of the node count, else it is a
spare. Events: "spare" (a node kept as a spare), "spare-taken".

Keys of generations before g (halts, sync reports, last-step marks, group stores) are deleted
when g+1 is published, so etcd holds O(workers) of them whatever the run's length.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

from elastic.coordinator.client import etcd_unreachable
from elastic.coordinator.election import LeaderElection
from elastic.coordinator.etcd_api import Compare, EtcdClient
from elastic.coordinator.events import record_event
from elastic.coordinator.generations import GenerationConflict, Generations
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.coordinator.watch import PrefixWatch, WatchEvent
from elastic.planning.cluster import cluster_templates
from elastic.planning.spares import newcomers_to_join, spares_to_take, substitute
from elastic.planning.stragglers import ACTING, planner_split
from elastic.records.config import ElasticConfig
from elastic.records.generation import GenerationRecord, HaltRecord, Vote
from elastic.records.injection import (
    InjectionRequest,
    InjectionStatus,
    read_requests,
    read_statuses,
    request_id,
    submit_request,
    write_status,
)
from elastic.records.partial import resolve_replay, worth_finishing
from elastic.records.progress import read_progress
from elastic.records.stop import StopRequest, read_stop, stop_key
from elastic.records.stragglers import read_policy, read_stragglers
from elastic.records.sync import ABORT, COMMIT, SyncReport
from elastic.records.workers import WorkerInfo, live_nodes
from elastic.roles.holders import read_holdings
from elastic.roles.straggler_decisions import DrainStraggler, Resplit, straggler_decision
from elastic.transfer.shards import ShardKey
from templates.instantiation import instantiate
from templates.plan import Plan
from templates.replanning import replan
from templates.template_set import PlanningError, TemplateSet

log = logging.getLogger(__name__)

_IDLE_ROUND_S = 1.0
"""A round runs at least this often without a watch event (membership changes wake it at once)."""


class FallbackImpossible(RuntimeError):
    """The survivors lost a layer and there is no complete checkpoint to restore."""


class NotLeader(RuntimeError):
    """A fenced write found that this agent no longer leads (a stale leader resumed after a hang)."""


def decide(
    client: EtcdClient, rk: RunKeys, generation: int, step: int, decision: str, *,
    fence: Compare | None = None,
) -> str:
    """Create the decision of (generation, step) if absent; return the decision that stands.
    With `fence` (the election's leader compare) the decision is written only while this agent
    leads: NotLeader otherwise, so a leader that was SIGSTOPped and resumed cannot abort a step
    of a generation it no longer runs."""
    key = rk.decision(generation, step)
    txn = client.transactions
    compare = [txn.create(key) == 0, *([fence] if fence is not None else [])]
    ok, _ = client.transaction(compare=compare, success=[txn.put(key, decision)], failure=[])
    if ok:
        return decision
    value, _ = client.get(key)
    if value is None:
        raise NotLeader(f"decision {key} not written: this agent is no longer the leader")
    return str(value.decode())


def surviving_holders_cover(plan: Plan, live: set[int]) -> bool:
    """Whether every layer of `plan` has a holder among `live` nodes."""
    return all(
        any(st.node in live for pipe in plan.pipelines for st in pipe.stages if st.first <= layer < st.last)
        for layer in range(plan.num_layers)
    )


def live_holdings_gaps(
    client: EtcdClient, rk: RunKeys, plan: Plan, live: set[int]
) -> list[ShardKey] | None:
    """The (layer, tp_rank) shards that no live worker reports holding; None when no worker has
    reported yet (nothing trained: the seed state is everywhere)."""
    holdings = read_holdings(client, rk)
    if not holdings:
        return None
    held = {shard for (node, _), shards in holdings.items() if node in live for shard in shards}
    return [
        ShardKey(layer, t)
        for layer in range(plan.num_layers)
        for t in range(plan.gpus_per_node)
        if (layer, t) not in held
    ]


REBALANCE_GAIN = 0.1
"""Least estimated step-time gain (a fraction) for which the leader acts on stragglers
(`--straggler-policy rebalance` or `auto`)."""


class Leader:
    """Runs the leader's rounds while `election` says this agent leads (see the module doc)."""

    def __init__(self, client: EtcdClient, keys: JobKeys, config: ElasticConfig, election: LeaderElection,
                 *, who: str) -> None:
        self.client, self.keys, self.rk = client, keys, RunKeys(keys)
        self.config, self.election, self.who = config, election, who
        self.generations = Generations(client, keys)
        # Templates for every pipeline size up to N (f = 0): relaxing f may need the longer ones.
        self.tset: TemplateSet = cluster_templates(dataclasses.replace(config.cluster, fault_tolerance=0))
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._detected: float | None = None
        self._thread: threading.Thread | None = None
        self._record: tuple[int, GenerationRecord] | None = None
        self._spares_seen: set[tuple[int, int]] = set()
        """(node, incarnation) of the spares whose "spare" event this leader recorded."""
        self._stop_request: StopRequest | None = None
        """The job's stop request, once seen (elastic/records/stop.py)."""
        self._straggler_config = config.stragglers
        """The straggler settings in force (the run's, or the operator's change)."""
        self._straggler_drains: set[tuple[int, int]] = set()
        """(node, incarnation) of the stragglers this leader asked to drain (once each)."""
        self.rounds = 0
        """Rounds run so far (for benchmarks and tests)."""
        self.finished = threading.Event()

    def start(self) -> Leader:
        self._thread = threading.Thread(target=self._run, name="leader", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _on_events(self, events: list[WatchEvent]) -> None:
        self._wake.set()

    def _run(self) -> None:
        # Watched only while leading: standby agents must not receive every sync report.
        prefixes = (self.keys.members, self.rk.workers, self.rk.prefix("sync"), self.rk.prefix("ready"), self.keys.injections,
                    stop_key(self.keys))
        watches: list[PrefixWatch] = []
        try:
            while not self._stop.is_set() and not self.finished.is_set():
                if not self.election.wait_leader(0.2):
                    for w in watches:
                        w.cancel()
                    watches = []
                    continue
                if not watches:
                    watches = [PrefixWatch(self.client, p, self._on_events) for p in prefixes]
                self._wake.clear()
                try:
                    self._round()
                    self.rounds += 1
                except (GenerationConflict, NotLeader) as exc:
                    log.warning("leader %s: %s", self.who, exc)
                except FallbackImpossible as exc:
                    log.error("leader %s: %s", self.who, exc)
                    record_event(self.client, self.keys, who=self.who, kind="fatal", reason=str(exc))
                    self.client.put(self.keys.fatal, str(exc))
                    return
                except Exception as exc:
                    if not etcd_unreachable(exc):
                        raise
                    # etcd out of reach past the client's retries (no quorum, restarting): a
                    # round reads everything afresh, so the next one simply starts over
                    log.warning("leader %s: etcd did not answer (%s); trying again", self.who, type(exc).__name__)
                self._wake.wait(_IDLE_ROUND_S)
        except Exception:
            log.exception("leader %s failed", self.who)
            raise
        finally:
            for w in watches:
                w.cancel()

    # ---- one round -----------------------------------------------------------------------

    def _current(self) -> tuple[int, GenerationRecord] | None:
        """The current generation and its record (the record is read once per generation)."""
        g = self.generations.current_number()
        if self._record is None or self._record[0] != g:
            gen = self.generations.get(g)
            if gen is None:
                return None
            self._record = (g, GenerationRecord.from_json(gen.plan))
        return self._record

    def _round(self) -> None:
        current = self._current()
        if current is None:
            return
        g, record = current
        members = live_nodes(self.client, self.keys)
        last = self.config.spec.steps - 1
        lost = sorted(n for n, inc in record.incarnations.items() if members.get(n) != inc)
        if lost:
            if self._last_step_committed(g, last) or self._stopped_for_good(g):
                self.finished.set()  # nodes leave once the job is done (or stopped): not a loss
                return
            if self._detected is None:
                self._detected = time.time()
            fence = self.election.leader_compare()
            finish = self._worth_finishing()
            self._halt(g, abort=True, lost=lost if finish else [],
                       reason=f"lost node(s) {lost}" + ("" if finish else ", early in the step: every pipeline stops"))
            if decide(self.client, self.rk, g, last, ABORT, fence=fence) == COMMIT:
                self.finished.set()  # the job's last step committed: nothing to recover
                return
            reports = self._sync_reports(g, record, members)
            if reports is not None:
                taken = self._spares_for(record, members, lost)
                self._resolve_and_publish(g, record, reports, members, lost=lost, joined=taken)
            return
        if self._decide_last_step(g, record):
            return
        if self._stop_requested():
            self._stop_job(g, record, members)
            return
        joined = self._joining(record, members)
        drain = None if joined else self._acceptable_drain(g, record, members)
        balance = None if joined or drain else self._stragglers(g, record, members)
        if not joined and drain is None and balance is None:
            return
        # A step boundary: the workers finish the in-flight step and stop after it.
        if self._detected is None:
            self._detected = time.time()
        what = (f"node(s) {joined} joining" if joined else f"drain of node {drain[0].node}" if drain
                else "a rebalance for stragglers")
        self._halt(g, abort=False, reason=what)
        reports = self._sync_reports(g, record, members)
        if reports is None:
            return
        if joined:
            self._resolve_and_publish(g, record, reports, members, lost=[], joined=joined)
            return
        if balance is not None:
            self._resolve_and_publish(g, record, reports, members, lost=[], joined=[],
                                      planned=(balance.plan, balance.reason), balanced_for=balance.balanced_for)
            return
        assert drain is not None
        req, plan, reason, taken = drain
        for spare in taken:
            record_event(self.client, self.keys, who=self.who, kind="spare-taken", node=spare,
                         incarnation=members[spare], lost=[], drained=[req.node], generation=g + 1)
        if self._resolve_and_publish(g, record, reports, members, lost=[], joined=taken, drained=[req.node],
                                     planned=(plan, reason)):
            self._answer(req, "done", reason, generation=g + 1)
        else:
            self._answer(req, "refused", "the job finished before a step boundary came")

    # ---- a whole-job stop (elastic/records/stop.py) ----------------------------------------

    def _stop_requested(self) -> bool:
        """Whether the job's stop was asked (one key read until it is)."""
        if self._stop_request is None:
            self._stop_request = read_stop(self.client, self.keys)
        return self._stop_request is not None

    def _stop_job(self, g: int, record: GenerationRecord, members: dict[int, int]) -> None:
        """Halt g at the next step boundary; once every live worker reported the same committed
        steps S, write `stop_step` S into the halt: each worker checkpoints step S and leaves. A
        worker whose vote was cut short (a failure meanwhile) is settled in a generation of its
        own first, and the stop is met at that generation's first boundary."""
        assert self._stop_request is not None
        if self._detected is None:
            self._detected = time.time()
        self._halt(g, abort=False, reason=f"stop of the whole job ({self._stop_request.words()}) at the next step boundary")
        reports = self._sync_reports(g, record, members)
        if reports is None:
            return
        committed = {r.committed for r in reports}
        if len(committed) != 1 or None in committed or any(r.pending is not None for r in reports):
            self._resolve_and_publish(g, record, reports, members, lost=[], joined=[])
            return
        step = committed.pop()
        assert step is not None
        key = self.rk.halt(g)
        value, _ = self.client.get(key)
        assert value is not None  # halted above
        halt = dataclasses.replace(HaltRecord.from_json(value), stop_step=step)
        ok, _ = self.client.transaction(compare=[self.election.leader_compare()],
                                        success=[self.client.transactions.put(key, halt.to_json())], failure=[])
        if not ok:
            raise NotLeader(f"stop of {key} not written: this agent is no longer the leader")
        log.warning("leader %s: the job stops after step %d (generation %d): %s", self.who, step, g, self._stop_request.words())
        record_event(self.client, self.keys, who=self.who, kind="stopped", generation=g, step=step,
                     by=self._stop_request.by)
        self.finished.set()

    def _stopped_for_good(self, g: int) -> bool:
        """Whether generation g's halt carries the job's stop (one key read)."""
        value, _ = self.client.get(self.rk.halt(g))
        return value is not None and HaltRecord.from_json(value).stop_step is not None

    def _worth_finishing(self) -> bool:
        """Whether the in-flight step is far enough along for the pipelines that lost no node to
        finish it (partial.worth_finishing, from the progress key: one read)."""
        if not self.config.spec.partial_replay:
            return False
        record = read_progress(self.client, self.rk)
        return record is None or worth_finishing(time.time() - record.committed_at, record.seconds)

    def _halt(self, g: int, *, abort: bool, reason: str, lost: list[int] | None = None) -> None:
        """Write `halt/<g>` (fenced) unless a halt at least as strong is there already. An abort
        halt naming lost nodes lets the other pipelines finish their microbatches; it is
        rewritten when more nodes are lost (their pipelines must stop too), and an abort halt
        naming none stops every pipeline."""
        key = self.rk.halt(g)
        value, _ = self.client.get(key)
        if value is not None:
            old = HaltRecord.from_json(value)
            if not abort or (old.abort and (not old.lost or (lost and set(lost) <= set(old.lost)))):
                return
        halt = HaltRecord(abort=abort, reason=reason, at=time.time(), lost=sorted(lost or []))
        ok, _ = self.client.transaction(compare=[self.election.leader_compare()],
                                        success=[self.client.transactions.put(key, halt.to_json())], failure=[])
        if not ok:
            raise NotLeader(f"halt {key} not written: this agent is no longer the leader")
        log.warning("leader %s: halted generation %d (%s): %s", self.who, g, "abort" if abort else "at a step boundary", reason)

    def _last_step_committed(self, g: int, last: int) -> bool:
        """Whether the job's last step was decided "commit" in generation g (one key read)."""
        value, _ = self.client.get(self.rk.decision(g, last))
        return value is not None and value.decode() == COMMIT

    def _decide_last_step(self, g: int, record: GenerationRecord) -> bool:
        """Commit the job's last step once every rank of g is ready for it; True when the job is done."""
        last = self.config.spec.steps - 1
        world = len(record.plan.nodes) * record.plan.gpus_per_node
        resp = self.client.get_prefix_response(self.rk.prefix("ready", g, last), count_only=True)
        if int(resp.count) < world:
            return False
        if decide(self.client, self.rk, g, last, COMMIT, fence=self.election.leader_compare()) == COMMIT:
            self.finished.set()
            return True
        return False

    def _sync_reports(self, g: int, record: GenerationRecord, members: dict[int, int]) -> list[SyncReport] | None:
        """Every live worker's sync report of g; None while some are missing."""
        expected = {(n, r) for n in record.plan.nodes if members.get(n) == record.incarnations.get(n)
                    for r in range(record.plan.gpus_per_node)}
        written = self.client.get_prefix_response(self.rk.sync(g), count_only=True)
        if int(written.count) < len(expected):  # rounds woken by each report: count, don't read them all
            return None
        reports: dict[tuple[int, int], SyncReport] = {}
        for value, _ in self.client.get_prefix(self.rk.sync(g)):
            try:
                report = SyncReport.from_json(value)
            except (ValueError, TypeError, KeyError):
                continue
            reports[(report.node, report.local_rank)] = report
        if not expected <= reports.keys():
            return None
        return [reports[k] for k in sorted(expected)]

    # ---- stragglers (elastic/planning/stragglers.py) ---------------------------------------

    def _stragglers(self, g: int, record: GenerationRecord, members: dict[int, int]) -> Resplit | None:
        """A re-split for stragglers to publish, or None (roles/straggler_decisions.py). Under
        `auto`, a spare or a drop is a drain request of the straggler, carried out by the drain
        path from the next round (once per incarnation). One or two key reads a round."""
        policy = self._straggler_policy()
        if policy not in ACTING and not record.balanced_for:
            return None
        try:
            speeds = read_stragglers(self.client, self.keys)
        except Exception as exc:  # noqa: BLE001 - unreadable or unreachable: no change this round
            log.warning("leader %s: cannot read the stragglers record: %s", self.who, exc)
            return None
        decision = straggler_decision(
            policy=policy, g=g, record=record, speeds=speeds, tset=self.tset, gain=REBALANCE_GAIN,
            spare_for=lambda node: next(iter(self._spares_for_drain(record, members, node)), None))
        if not isinstance(decision, DrainStraggler):
            return decision
        incarnation = record.incarnations[decision.node]
        if (decision.node, incarnation) not in self._straggler_drains:
            self._straggler_drains.add((decision.node, incarnation))
            req = InjectionRequest(id=request_id("drain", decision.node, None), kind="drain", node=decision.node,
                                   incarnation=incarnation, requested_at=time.time(), by="stragglers")
            submit_request(self.client, self.keys.root, req)
            record_event(self.client, self.keys, who=self.who, kind="straggler-action", node=decision.node,
                         choice=decision.choice, factor=round(decision.factor, 3), id=req.id,
                         reason=f"drain node {decision.node} ({decision.choice}): estimated step {decision.estimates}")
            log.warning("leader %s: straggler node %d at %.2fx: %s (estimated step %s)", self.who, decision.node,
                        decision.factor, decision.choice, decision.estimates)
        return None

    def _straggler_policy(self) -> str:
        """The straggler policy in force: the run's, or the operator's change (one key read)."""
        try:
            self._straggler_config = read_policy(self.client, self.keys, self.config.stragglers)
        except ValueError as exc:  # malformed (the CLI checks what it writes): keep the last good one
            log.warning("leader %s: ignoring the straggler settings in etcd: %s", self.who, exc)
        return self._straggler_config.policy

    # ---- drains --------------------------------------------------------------------------

    def _drain_requests(self) -> tuple[list[InjectionRequest], set[tuple[int, int | None]]]:
        """(pending drain requests, (node, incarnation) of the drains carried out)."""
        requests = [r for r in read_requests(self.client, self.keys.root) if r.kind == "drain"]
        if not requests:
            return [], set()
        statuses = read_statuses(self.client, self.keys.root)
        pending = [r for r in requests if r.id not in statuses]
        done = {
            (r.node, r.incarnation) for r in requests if r.id in statuses and statuses[r.id].state == "done"
        }
        return pending, done

    def _answer(self, req: InjectionRequest, state: str, detail: str, generation: int | None = None) -> None:
        status = InjectionStatus(state=state, at=time.time(), generation=generation, detail=detail)  # type: ignore[arg-type]
        write_status(self.client, self.keys.root, req.id, status)
        record_event(self.client, self.keys, who=self.who, kind="drain" if state == "done" else "drain-refused",
                     node=req.node, id=req.id, reason=detail, generation=generation)
        log.warning("leader %s: drain %s %s: %s", self.who, req.id, state, detail)

    def _acceptable_drain(self, g: int, record: GenerationRecord, members: dict[int, int]
                          ) -> tuple[InjectionRequest, Plan, str, list[int]] | None:
        """The first pending drain request that can be met, with its plan, reason and the spare
        taken in (if one is ready, it takes the node's stage at the planner's split: the job keeps
        its node count); requests that cannot be met are refused on the way."""
        requests, _ = self._drain_requests()
        for req in requests:
            if req.node not in record.plan.nodes or record.incarnations.get(req.node) != req.incarnation:
                self._answer(req, "refused", f"node {req.node} (incarnation {req.incarnation}) is not in "
                             f"generation {g} (nodes {sorted(record.plan.nodes)})")
                continue
            taken = self._spares_for_drain(record, members, req.node)
            if taken:
                split = planner_split(self.tset, record.plan) if record.balanced_for else record.plan
                return (req, substitute(split, {req.node: taken[0]}),
                        f"drained node {req.node}: hot spare {taken[0]} took its stage", taken)
            others = sorted(n for n in record.plan.nodes if n != req.node)
            f = record.plan.fault_tolerance
            try:
                plan = replan(self.tset, record.plan, others, global_microbatches=record.plan.global_microbatches,
                              fault_tolerance=f).plan
            except PlanningError as exc:
                self._answer(req, "refused", f"draining node {req.node} would leave nodes {others}, which cannot "
                             f"form the {f + 1} pipelines that fault tolerance {f} needs: {exc}")
                continue
            return req, plan, f"drained node {req.node}: re-planned over nodes {others}", []
        return None

    # ---- hot spares (elastic/planning/spares.py) ------------------------------------------

    def _ready_spares(self, record: GenerationRecord, members: dict[int, int]) -> list[int]:
        """Ready newcomers, less a drained node's incarnation (never taken back in)."""
        ready = self._ready_newcomers(record, members)
        if ready:
            _, drained = self._drain_requests()
            ready = [n for n in ready if (n, members[n]) not in drained]
        return ready

    def _spares_for(self, record: GenerationRecord, members: dict[int, int], lost: list[int]) -> list[int]:
        """The spares the re-plan that drops `lost` takes in (none when none is ready, and none
        without hot spares configured: a loss is then re-planned over the survivors, as before)."""
        if self.config.spares == 0:
            return []
        survivors = [n for n in record.plan.nodes if n not in lost]
        taken = spares_to_take(survivors=survivors, ready=self._ready_spares(record, members),
                               active=self.config.cluster.nodes)
        for node in taken:
            record_event(self.client, self.keys, who=self.who, kind="spare-taken", node=node,
                         incarnation=members[node], lost=lost, generation=self._record[0] + 1 if self._record else None)
        return taken

    def _spares_for_drain(self, record: GenerationRecord, members: dict[int, int], node: int) -> list[int]:
        """The spare (at most one) that would take drained `node`'s stage: none when none is ready."""
        survivors = [n for n in record.plan.nodes if n != node]
        return spares_to_take(survivors=survivors, ready=self._ready_spares(record, members),
                              active=self.config.cluster.nodes)[:1]

    def _joining(self, record: GenerationRecord, members: dict[int, int]) -> list[int]:
        """Ready newcomers that join at the next step boundary. With hot spares configured, as many
        as the plan lacks to reach the job's node count; the others stay spares (an event says so
        once per incarnation). Without, every ready newcomer, as before spares existed."""
        ready = self._ready_spares(record, members)
        if self.config.spares == 0:  # no hot spares: every ready newcomer joins, as it always did
            return ready
        joined = newcomers_to_join(current=record.plan.nodes, ready=ready, active=self.config.cluster.nodes)
        for node in ready:
            if node not in joined and (node, members[node]) not in self._spares_seen:
                self._spares_seen.add((node, members[node]))
                record_event(self.client, self.keys, who=self.who, kind="spare", node=node,
                             incarnation=members[node], generation=self._record[0] if self._record else None)
                log.warning("leader %s: node %d (incarnation %d) is a hot spare", self.who, node, members[node])
        return joined

    def _ready_newcomers(self, record: GenerationRecord, members: dict[int, int]) -> list[int]:
        """Nodes alive but not in the generation whose workers have all registered."""
        gpus = record.plan.gpus_per_node
        out = []
        for node, inc in sorted(members.items()):
            if record.incarnations.get(node) == inc:
                continue
            registered = [
                WorkerInfo.from_json(v) for v, _ in self.client.get_prefix(self.rk.node_workers(node))
            ]
            if sum(1 for w in registered if w.incarnation == inc) >= gpus:
                out.append(node)
        return out

    # ---- the next generation -------------------------------------------------------------

    @staticmethod
    def _resume(record: GenerationRecord, reports: list[SyncReport]) -> tuple[int, Vote | None]:
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

    def _resolve_and_publish(self, g: int, record: GenerationRecord, reports: list[SyncReport],
                             members: dict[int, int], *, lost: list[int], joined: list[int],
                             drained: list[int] | None = None,
                             planned: tuple[Plan, str] | None = None, balanced_for: list[int] | None = None) -> bool:
        """Publish g+1 (False: the job's last step was committed first). `planned`: its plan and reason."""
        synced = time.time()
        resume, vote = self._resume(record, reports)
        if resume >= self.config.spec.steps:
            self.finished.set()
            return False
        if planned is not None:
            plan, restore, reason = planned[0], None, planned[1]
        else:
            live = sorted(n for n, inc in members.items() if record.incarnations.get(n) == inc or n in joined)
            plan, restore, reason = self._plan_for(record.plan, live, lost=lost, joined=joined)
        replay = None
        if lost and restore is None:
            replay = resolve_replay(plan, [(r.node, r.local_rank, r.partial) for r in reports], step=resume)
        new = GenerationRecord(
            plan=plan,
            resume_step=resume if restore is None else restore,
            incarnations={n: members[n] for n in plan.nodes},
            lost=lost,
            joined=joined,
            drained=drained or [],
            restore_checkpoint=restore,
            restore_dir=self._restore_dir(restore),
            reason=reason,
            detected_at=self._detected,
            synced_at=synced,
            published_at=time.time(),
            completed_vote=vote if restore is None else None,
            replay=replay,
            balanced_for=balanced_for or [],
        )
        self.generations.publish(new.to_json(), expected=g, fence=self.election.leader_compare())
        self._detected = None
        log.warning("leader %s: published generation %d: %s", self.who, g + 1, reason)
        record_event(self.client, self.keys, who=self.who, kind="generation", generation=g + 1,
                     lost=lost, joined=joined, drained=drained or [], reason=reason,
                     restore_checkpoint=restore, replayed_fraction=new.replayed_fraction,
                     **({} if replay is None else {"kept_microbatches": replay.kept,
                                                   "recomputed": replay.recomputed}))
        self._forget(g - 1)
        return True

    def _restore_dir(self, restore: int | None) -> str | None:
        """Where checkpoint step `restore` lies when it is not in the job's own directory: a
        resumed run writes only steps after the one it resumed from, so that step is the
        earlier run's."""
        resume = self.config.resume
        if restore is None or resume is None or restore != resume.step:
            return None
        return resume.checkpoint_dir

    def _forget(self, g: int) -> None:
        """Delete what generation `g` (and any before it) left that no one reads any more."""
        if g < 1:
            return
        for prefix in (self.rk.sync(g), self.rk.halt(g), self.rk.prefix("ready", g), self.rk.prefix("decisions", g),
                       self.keys.store(f"gen-{g}")):
            self.client.delete_prefix(prefix)

    def _verified_checkpoint(self, plan: Plan) -> tuple[int | None, list[tuple[int, str]]]:
        """The newest complete checkpoint whose every file matches its marker's CRC-32, and the
        newer complete ones skipped as corrupt (step, why), each reported once as a
        `checkpoint-skipped` event naming the file. Reading every file is a fallback's cost,
        never a step's."""
        from elastic.engine.checkpoint_files import CheckpointError, complete_steps
        from elastic.engine.checkpoint_resume import verify_crcs

        directory = Path(self.config.checkpoint_path)
        skipped: list[tuple[int, str]] = []
        for step in reversed(complete_steps(directory, num_layers=plan.num_layers, tp_degree=plan.gpus_per_node)):
            try:
                verify_crcs(directory, step)
            except CheckpointError as exc:
                skipped.append((step, str(exc)))
                log.warning("leader %s: skipping the checkpoint of step %d: %s", self.who, step, exc)
                record_event(self.client, self.keys, who=self.who, kind="checkpoint-skipped", step=step,
                             reason=str(exc))
                continue
            return step, skipped
        return None, skipped

    def _plan_for(
        self, plan: Plan, live: list[int], *, lost: list[int], joined: list[int]
    ) -> tuple[Plan, int | None, str]:
        what = ", ".join([*(f"lost node {n}" for n in lost), *(f"node {n} joined" for n in joined)])
        f = plan.fault_tolerance
        mbs = plan.global_microbatches
        # What live workers report holding decides, not the plan: a reconfiguration cut short by
        # a second failure may have left a plan's holder without its shards.
        gaps = live_holdings_gaps(self.client, self.rk, plan, set(live))
        if gaps is None:
            gaps = [] if surviving_holders_cover(plan, set(live)) else [ShardKey(-1, -1)]
        if not gaps and lost and len(joined) == len(lost) and not set(joined) & set(plan.nodes):
            # Hot spares replace every lost node: the same instantiation, each spare in a lost
            # node's stage (elastic/planning/spares.py); it fetches that node's shards.
            swap = dict(zip(sorted(lost), sorted(joined), strict=True))
            return (substitute(plan, swap), None,
                    f"{what}: hot spare(s) took the lost nodes' stages ({', '.join(f'{n} -> {s}' for n, s in swap.items())})")
        if not gaps:
            for f_now in range(f, -1, -1):
                try:
                    new = replan(self.tset, plan, live, global_microbatches=mbs, fault_tolerance=f_now).plan
                except PlanningError:
                    continue
                relaxed = "" if f_now == f else f"; fault tolerance relaxed from {f} to {f_now}"
                return new, None, f"{what}: re-planned over nodes {live}{relaxed}"
        spec = self.config.spec
        ckpt, skipped = self._verified_checkpoint(plan)
        resume = self.config.resume
        if ckpt is None and resume is not None:  # a resumed run before its own first checkpoint
            ckpt = resume.step
        if ckpt is None:
            raise FallbackImpossible(
                f"{what}: shards {gaps} have no live holder and no complete checkpoint exists in "
                f"{self.config.checkpoint_path}; the job cannot continue"
            )
        for f_now in range(f, -1, -1):
            try:
                new = instantiate(self.tset, live, global_microbatches=mbs, fault_tolerance=f_now)
            except PlanningError:
                continue
            relaxed = "" if f_now == f else f", fault tolerance relaxed from {f} to {f_now}"
            return (
                new,
                ckpt,
                (
                    f"{what}: "
                    + (
                        f"shards {gaps} have no live holder"
                        if gaps
                        else f"too few nodes for {f + 1} pipelines"
                    )
                    + "; "
                    f"CHECKPOINT FALLBACK: restoring step {ckpt} of {spec.steps} on nodes {live}{relaxed}"
                    + "".join(f"; skipped the corrupt checkpoint of step {step}" for step, _ in skipped)
                ),
            )
        raise FallbackImpossible(f"{what}: no plan fits the live nodes {live} even with fault tolerance 0")
