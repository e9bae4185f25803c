"""The leader's loop, inside the elected agent: the one file of the leader that touches etcd.

Each round (woken by a change under members/, workers/, sync/, ready/, injections/ or the stop
key, or every second) reads what a decision needs into one `Snapshot` (the members through
`SuspectGuard`, roles/leader_suspects.py: a node whose lease expired is removed only when its
probe does not answer either) (roles/leader_snapshot.py:
O(nodes) keys, never a per-step key), asks `decide_round` (roles/leader_decisions.py, pure; its
module doc is the table of cases: lost, join, drain, spare, straggler, fallback, stop, last
step) for the round's writes (roles/leader_actions.py), and carries them out in that order,
fenced by the leader key: halts, the last step's decision, generation g+1 (re-planned by
roles/leader_replan.py), drain answers, events. It keeps nothing that etcd does not have, but
which spare events and straggler drains it recorded already, and a mirror of the sync reports
(decoded as they arrive, kept by a watch): a newly elected leader reads the current generation,
its halt and the sync reports written so far, and goes on from there.
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
from elastic.coordinator.prefix_mirror import PrefixMirror
from elastic.coordinator.watch import PrefixWatch, WatchEvent
from elastic.planning.cluster import replan_templates
from elastic.planning.stragglers import ACTING
from elastic.records.config import ElasticConfig
from elastic.records.generation import GenerationRecord, HaltRecord
from elastic.records.injection_requests import (
    InjectionRequest,
    InjectionStatus,
    read_requests,
    read_statuses,
    request_id,
    submit_request,
    write_status,
)
from elastic.records.node_sync import reports_of
from elastic.records.node_workers import read_registrations
from elastic.records.progress import read_progress
from elastic.records.stop import StopRequest, read_stop, stop_key
from elastic.records.stragglers import StragglerRecord, read_policy, read_stragglers
from elastic.records.sync import COMMIT
from elastic.roles.holders import read_holdings
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
from elastic.roles.leader_decisions import decide_round
from elastic.roles.leader_replan import FallbackImpossible, fallback_plan, restore_dir, verified_checkpoint
from elastic.roles.leader_snapshot import Snapshot, live_workers
from elastic.roles.leader_suspects import NoLongerLeader, SuspectGuard
from elastic.roles.leader_sync import sync_reports
from elastic.roles.recovery_summary import fold_generation
from templates.template_set import TemplateSet

log = logging.getLogger(__name__)

_IDLE_ROUND_S = 1.0
"""A round runs at least this often without a watch event (membership changes wake it at once)."""


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


def read_registered(client: EtcdClient, rk: RunKeys, record: GenerationRecord, members: dict[int, int]
                    ) -> dict[int, int]:
    """Live node whose incarnation is not in the generation -> its workers registered with that incarnation."""
    out = {}
    for node, inc in sorted(members.items()):
        if record.incarnations.get(node) == inc:
            continue
        registered = read_registrations(client, rk, node=node).values()
        out[node] = sum(1 for w in registered if w.incarnation == inc)
    return out


def read_drains(client: EtcdClient, keys: JobKeys) -> tuple[list[InjectionRequest], frozenset[tuple[int, int | None]]]:
    """(pending drain requests, (node, incarnation) of the drains carried out)."""
    requests = [r for r in read_requests(client, keys.root) if r.kind == "drain"]
    if not requests:
        return [], frozenset()
    statuses = read_statuses(client, keys.root)
    pending = [r for r in requests if r.id not in statuses]
    done = frozenset(
        (r.node, r.incarnation) for r in requests if r.id in statuses and statuses[r.id].state == "done"
    )
    return pending, done


class Leader:
    """Runs the leader's rounds while `election` says this agent leads (see the module doc)."""

    def __init__(self, client: EtcdClient, keys: JobKeys, config: ElasticConfig, election: LeaderElection,
                 *, who: str) -> None:
        self.client, self.keys, self.rk = client, keys, RunKeys(keys)
        self.config, self.election, self.who = config, election, who
        self.generations = Generations(client, keys)
        self.tset: TemplateSet = replan_templates(config.cluster)
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
        self._sync: PrefixMirror | None = None
        """The sync reports while leading, decoded as they come (`sync_reports`)."""
        self.guard = SuspectGuard(client, keys, who=who, fault_tolerance=config.cluster.fault_tolerance,
                                  ttl=config.lease_ttl, fence=election.leader_compare)
        """The second witness of a lease expiry (roles/leader_suspects.py)."""
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
        # Watched only while leading: standby agents must not receive every sync report (sync/
        # is watched by the leader's mirror of it, made by the first round that leads).
        prefixes = (self.keys.members, self.rk.workers, self.rk.prefix("ready"), self.keys.injections, stop_key(self.keys))
        watches: list[PrefixWatch] = []
        try:
            while not self._stop.is_set() and not self.finished.is_set():
                if not self.election.wait_leader(0.2):
                    for w in watches:
                        w.cancel()
                    watches = []
                    self._close_mirror()
                    continue
                if self._stop.is_set():  # stopped while it waited to lead: an agent on its way out
                    break  # must not start a round (one took 1.1 s of an agent's exit at a job's end)
                if not watches:
                    self.guard.reset()
                    watches = [PrefixWatch(self.client, p, self._on_events) for p in prefixes]
                self._wake.clear()
                try:
                    self._round()
                    self.rounds += 1
                except (GenerationConflict, NotLeader, NoLongerLeader) as exc:
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
            self._close_mirror()

    def _close_mirror(self) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None

    # ---- one round: read, decide, write ---------------------------------------------------

    def _round(self) -> None:
        snapshot = self._read()
        if snapshot is None:
            return
        for step in decide_round(snapshot, self.config, self.tset):
            if not self._carry_out(snapshot, step):
                return

    def _current(self) -> tuple[int, GenerationRecord] | None:
        """The current generation and its record (the record is read once per generation)."""
        g = self.generations.current_number()
        if self._record is None or self._record[0] != g:
            gen = self.generations.get(g)
            if gen is None:
                return None
            self._record = (g, GenerationRecord.from_json(gen.plan))
        return self._record

    def _read(self) -> Snapshot | None:
        """Everything this round's decision reads (roles/leader_snapshot.py): O(nodes) keys."""
        current = self._current()
        if current is None:
            return None
        g, record = current
        client, rk, last = self.client, self.rk, self.config.spec.steps - 1
        members = self.guard.members(record)  # suspects that answered their probe count live
        now = time.time()
        lost = any(members.get(n) != inc for n, inc in record.incarnations.items())
        halt, _ = client.get(rk.halt(g))
        if self._sync is None:
            self._sync = PrefixMirror(client, rk.prefix("sync"), reports_of,
                                      on_change=self._wake.set)
        reports = sync_reports(client, rk, self._sync, g, live_workers(record, members))
        requests, drained = read_drains(client, self.keys) if not lost or self.config.spares else ([], frozenset())
        decision, progress, ready = None, None, 0
        policy, speeds, unreadable = self._straggler_config.policy, None, False
        if lost:  # the last step's decision, and how far the in-flight step went (partial replay)
            value, _ = client.get(rk.decision(g, last))
            decision = None if value is None else value.decode()
            progress = read_progress(client, rk) if self.config.spec.partial_replay else None
        else:
            ready = int(client.get_prefix_response(rk.prefix("ready", g, last), count_only=True).count)
            if self._stop_request is None:  # one key read until it is asked
                self._stop_request = read_stop(client, self.keys)
            policy, speeds, unreadable = self._read_stragglers(record)
        return Snapshot(
            g=g, record=record, members=members, now=now, last_step_ready=ready, last_step_decision=decision,
            halt=None if halt is None else HaltRecord.from_json(halt), reports=reports,
            holdings=None if reports is None else read_holdings(client, rk),
            registered=read_registered(client, rk, record, members), drain_requests=requests, drained=drained,
            stop=self._stop_request, straggler_policy=policy, stragglers=speeds, stragglers_unreadable=unreadable,
            progress=progress, spares_noted=frozenset(self._spares_seen),
            drains_asked=frozenset(self._straggler_drains))

    def _read_stragglers(self, record: GenerationRecord) -> tuple[str, StragglerRecord | None, bool]:
        """(the straggler policy in force: the run's, or the operator's change, one key read;
        under an acting one or a split made for stragglers, the `stragglers` record; whether
        that record was unreadable)."""
        try:
            self._straggler_config = read_policy(self.client, self.keys, self.config.stragglers)
        except ValueError as exc:  # malformed (the CLI checks what it writes): keep the last good one
            log.warning("leader %s: ignoring the straggler settings in etcd: %s", self.who, exc)
        policy = self._straggler_config.policy
        if policy not in ACTING and not record.balanced_for:
            return policy, None, False
        try:
            return policy, read_stragglers(self.client, self.keys), False
        except Exception as exc:  # noqa: BLE001 - unreadable or unreachable: no change this round
            log.warning("leader %s: cannot read the stragglers record: %s", self.who, exc)
            return policy, None, True

    def _carry_out(self, s: Snapshot, step: Step) -> bool:
        """Carry out one write of the round; False: the round ends here (the job is done)."""
        if isinstance(step, Halt):
            self._halt(s.g, step)
        elif isinstance(step, DecideLastStep):
            last = self.config.spec.steps - 1
            if decide(self.client, self.rk, s.g, last, step.decision, fence=self.election.leader_compare()) == COMMIT:
                self.finished.set()  # the job's last step committed: nothing else to do
                return False
        elif isinstance(step, Publish):
            self._publish(s.g, step.record, synced=time.time())
        elif isinstance(step, PublishFallback):
            self._publish_fallback(s, step)
        elif isinstance(step, StopAt):
            self._stop_at(s.g, step)
        elif isinstance(step, Finish):
            self.finished.set()
        elif isinstance(step, Answer):
            self._answer(step.request, step.state, step.detail, step.generation)
        elif isinstance(step, AskDrain):
            self._ask_drain(step)
        elif isinstance(step, NoteSpare):
            self._spares_seen.add((step.node, step.incarnation))
            record_event(self.client, self.keys, who=self.who, kind="spare", node=step.node,
                         incarnation=step.incarnation, generation=step.generation)
            log.warning("leader %s: node %d (incarnation %d) is a hot spare", self.who, step.node, step.incarnation)
        elif isinstance(step, SpareTaken):
            drained = {} if step.drained is None else {"drained": step.drained}
            record_event(self.client, self.keys, who=self.who, kind="spare-taken", node=step.node,
                         incarnation=step.incarnation, lost=step.lost, **drained, generation=step.generation)
        return True

    # ---- the writes ----------------------------------------------------------------------

    def _halt(self, g: int, halt: Halt) -> None:
        """Write `halt/<g>` (fenced) unless a halt at least as strong is there already."""
        if self._detected is None:
            self._detected = time.time()
        if not halt.write:
            return
        key = self.rk.halt(g)
        record = HaltRecord(abort=halt.abort, reason=halt.reason, at=time.time(), lost=halt.lost)
        ok, _ = self.client.transaction(compare=[self.election.leader_compare()],
                                        success=[self.client.transactions.put(key, record.to_json())], failure=[])
        if not ok:
            raise NotLeader(f"halt {key} not written: this agent is no longer the leader")
        log.warning("leader %s: halted generation %d (%s): %s", self.who, g,
                    "abort" if halt.abort else "at a step boundary", halt.reason)

    def _stop_at(self, g: int, stop: StopAt) -> None:
        """Rewrite the boundary halt of g with the job's `stop_step` (fenced), then finish."""
        key = self.rk.halt(g)
        value, _ = self.client.get(key)
        assert value is not None  # halted before
        halt = dataclasses.replace(HaltRecord.from_json(value), stop_step=stop.step)
        ok, _ = self.client.transaction(compare=[self.election.leader_compare()],
                                        success=[self.client.transactions.put(key, halt.to_json())], failure=[])
        if not ok:
            raise NotLeader(f"stop of {key} not written: this agent is no longer the leader")
        log.warning("leader %s: the job stops after step %d (generation %d): %s", self.who, stop.step, g, stop.words)
        record_event(self.client, self.keys, who=self.who, kind="stopped", generation=g, step=stop.step, by=stop.by)
        self.finished.set()

    def _publish(self, g: int, record: GenerationRecord, *, synced: float) -> None:
        """Publish g+1 (fenced compare-and-swap on g), its event, forget g-1 and fold g's recovery records."""
        new = dataclasses.replace(record, detected_at=self._detected, synced_at=synced, published_at=time.time())
        self.generations.publish(new.to_json(), expected=g, fence=self.election.leader_compare())
        self._detected = None
        log.warning("leader %s: published generation %d: %s", self.who, g + 1, new.reason)
        replay = new.replay
        record_event(self.client, self.keys, who=self.who, kind="generation", generation=g + 1,
                     lost=new.lost, joined=new.joined, drained=new.drained, reason=new.reason,
                     restore_checkpoint=new.restore_checkpoint, replayed_fraction=new.replayed_fraction,
                     **({} if replay is None else {"kept_microbatches": replay.kept,
                                                   "recomputed": replay.recomputed}))
        self._forget(g - 1)
        fold_generation(self.client, self.rk, g)  # superseded: its node records folded into one

    def _publish_fallback(self, s: Snapshot, step: PublishFallback) -> None:
        """Publish g+1 from the newest verified checkpoint (FallbackImpossible: there is none)."""
        synced = time.time()
        checkpoint, skipped = verified_checkpoint(Path(self.config.checkpoint_path), s.record.plan)
        for bad, why in skipped:
            log.warning("leader %s: skipping the checkpoint of step %d: %s", self.who, bad, why)
            record_event(self.client, self.keys, who=self.who, kind="checkpoint-skipped", step=bad, reason=why)
        resume = self.config.resume
        if checkpoint is None and resume is not None:  # a resumed run before its own first checkpoint
            checkpoint = resume.step
        fallback = step.fallback
        if checkpoint is None:
            raise FallbackImpossible(
                f"{fallback.what}: {fallback.cause or f'shards {fallback.gaps} have no live holder'} and no complete "
                f"checkpoint exists in "
                f"{self.config.checkpoint_path}; the job cannot continue"
            )
        plan, reason = fallback_plan(self.tset, s.record.plan, fallback, checkpoint=checkpoint,
                                     steps=self.config.spec.steps, skipped=skipped)
        record = GenerationRecord(
            plan=plan, resume_step=checkpoint, incarnations={n: step.members[n] for n in plan.nodes}, lost=step.lost,
            joined=step.joined, restore_checkpoint=checkpoint, restore_dir=restore_dir(self.config, checkpoint),
            reason=reason)
        self._publish(s.g, record, synced=synced)

    def _forget(self, g: int) -> None:
        """Delete what generation `g` (and any before it) left that no one reads any more, and fold
        any recovery record of it written after its fold (elastic/roles/recovery_summary.py)."""
        if g < 1:
            return
        for prefix in (self.rk.sync(g), self.rk.halt(g), self.rk.prefix("ready", g), self.rk.prefix("decisions", g),
                       self.keys.store(f"gen-{g}")):
            self.client.delete_prefix(prefix)
        fold_generation(self.client, self.rk, g)

    def _answer(self, req: InjectionRequest, state: str, detail: str, generation: int | None = None) -> None:
        status = InjectionStatus(state=state, at=time.time(), generation=generation, detail=detail)  # type: ignore[arg-type]
        write_status(self.client, self.keys.root, req.id, status)
        record_event(self.client, self.keys, who=self.who, kind="drain" if state == "done" else "drain-refused",
                     node=req.node, id=req.id, reason=detail, generation=generation)
        log.warning("leader %s: drain %s %s: %s", self.who, req.id, state, detail)

    def _ask_drain(self, ask: AskDrain) -> None:
        """Ask for a straggler's drain (a request `by` "stragglers") and say why in an event."""
        self._straggler_drains.add((ask.node, ask.incarnation))
        req = InjectionRequest(id=request_id("drain", ask.node, None), kind="drain", node=ask.node,
                               incarnation=ask.incarnation, requested_at=time.time(), by="stragglers")
        submit_request(self.client, self.keys.root, req)
        record_event(self.client, self.keys, who=self.who, kind="straggler-action", node=ask.node,
                     choice=ask.choice, factor=round(ask.factor, 3), id=req.id,
                     reason=f"drain node {ask.node} ({ask.choice}): estimated step {ask.estimates}")
        log.warning("leader %s: straggler node %d at %.2fx: %s (estimated step %s)", self.who, ask.node,
                    ask.factor, ask.choice, ask.estimates)
