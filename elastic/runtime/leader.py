"""The leader: commit decisions, failure handling and re-planning, inside the elected agent.

It keeps nothing that etcd does not have: a newly elected leader reads the current generation,
its record and the decisions written so far, and goes on from there. Each round (woken by any
change under members/, workers/ or steps/, or every 0.2 s):

- a member of the current generation is gone (lease revoked or expired): the in-flight step is
  decided "abort" (created only if no decision exists; if "commit" won, the next step is
  aborted instead), the live nodes are re-planned on the precomputed templates, and generation
  g+1 is published (fenced: only the leader can). If a layer has no surviving holder, or the
  survivors cannot form f+1 pipelines, the plan is rebuilt from scratch over the live nodes,
  relaxing f only as far as needed, and every worker restores the latest complete checkpoint;
- every rank of the current generation is ready for the in-flight step: "commit";
- a new node (a node id absent from the plan, or a new incarnation) has registered all its
  workers: when the in-flight step is committed, the step after it (barely begun) is decided
  "abort" and g+1 takes the node in from there: a join never throws away a step's work;
- a drain request (`elastic drain`, injections/): refused (with its reason in the request's
  status and an event) unless the other nodes of the generation can still form the job's f+1
  pipelines; otherwise at the next step boundary g+1 is published without the node ("drained
  node N"), whose workers serve their shards until g+1 has committed a step and then leave.
  A drained node's incarnation is never taken back in (a rejoin brings a new incarnation).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from elastic.coordinator.election import LeaderElection
from elastic.coordinator.events import record_event
from elastic.coordinator.generations import GenerationConflict, Generations
from elastic.coordinator.keys import JobKeys
from elastic.coordinator.watch import PrefixWatch, WatchEvent
from elastic.runtime.injection import (
    InjectionRequest,
    InjectionStatus,
    read_requests,
    read_statuses,
    write_status,
)
from elastic.runtime.planning import cluster_templates
from elastic.runtime.protocol import (
    ABORT,
    COMMIT,
    ElasticConfig,
    GenerationRecord,
    RunKeys,
    WorkerInfo,
    live_nodes,
)
from templates.instantiation import instantiate
from templates.plan import Plan
from templates.replanning import replan
from templates.template_set import PlanningError, TemplateSet

log = logging.getLogger(__name__)


class FallbackImpossible(RuntimeError):
    """The survivors lost a layer and there is no complete checkpoint to restore."""


class NotLeader(RuntimeError):
    """A fenced write found that this agent no longer leads (a stale leader resumed after a hang)."""


def decide(client: Any, rk: RunKeys, generation: int, step: int, decision: str, *, fence: Any = None) -> str:
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


def live_holdings_gaps(client: Any, rk: RunKeys, plan: Plan, live: set[int]) -> list[tuple[int, int]] | None:
    """The (layer, tp_rank) shards that no live worker reports holding; None when no worker has
    reported yet (nothing trained: the seed state is everywhere)."""
    held: set[tuple[int, int]] = set()
    reported = False
    for value, meta in client.get_prefix(rk.holdings):
        reported = True
        node = int(meta.key.decode().split("/")[-2])
        if node in live:
            held.update((int(a), int(b)) for a, b in json.loads(value))
    if not reported:
        return None
    return [
        (layer, t)
        for layer in range(plan.num_layers)
        for t in range(plan.gpus_per_node)
        if (layer, t) not in held
    ]


class Leader:
    """Runs the leader's rounds while `election` says this agent leads (see the module doc)."""

    def __init__(self, client: Any, keys: JobKeys, config: ElasticConfig, election: LeaderElection,
                 *, who: str) -> None:  # fmt: skip
        self.client, self.keys, self.rk = client, keys, RunKeys(keys)
        self.config, self.election, self.who = config, election, who
        self.generations = Generations(client, keys)
        # Templates for every pipeline size up to N (f = 0): relaxing f may need the longer ones.
        self.tset: TemplateSet = cluster_templates(dataclasses.replace(config.cluster, fault_tolerance=0))
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._detected: float | None = None
        self._thread: threading.Thread | None = None
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
        watches = [PrefixWatch(self.client, p, self._on_events)
                   for p in (self.keys.members, self.rk.workers, self.rk.steps)]  # fmt: skip
        try:
            while not self._stop.is_set() and not self.finished.is_set():
                if not self.election.wait_leader(0.2):
                    continue
                self._wake.clear()
                try:
                    self._round()
                except (GenerationConflict, NotLeader) as exc:
                    log.warning("leader %s: %s", self.who, exc)
                except FallbackImpossible as exc:
                    log.error("leader %s: %s", self.who, exc)
                    record_event(self.client, self.keys, who=self.who, kind="fatal", reason=str(exc))
                    self.client.put(self.keys.root + "fatal", str(exc))
                    return
                self._wake.wait(0.2)
        except Exception:
            log.exception("leader %s failed", self.who)
            raise
        finally:
            for w in watches:
                w.cancel()

    # ---- one round -----------------------------------------------------------------------

    def _round(self) -> None:
        g = self.generations.current_number()
        gen = self.generations.get(g)
        if gen is None:
            return
        record = GenerationRecord.from_json(gen.plan)
        members = live_nodes(self.client, self.keys)
        steps = self.config.spec.steps
        in_flight, ready, decided = self._in_flight(g, record)
        if in_flight >= steps:
            self.finished.set()
            return
        lost = sorted(n for n, inc in record.incarnations.items() if members.get(n) != inc)
        if lost:
            if self._detected is None:
                self._detected = time.time()
            self._resolve_and_publish(g, record, in_flight, members, lost=lost, joined=[])
            return
        if decided is None and ready >= len(record.plan.nodes) * record.plan.gpus_per_node:
            decide(self.client, self.rk, g, in_flight, COMMIT, fence=self.election.leader_compare())
            joined = self._ready_newcomers(record, members)
            if joined:  # a drained node's incarnation is never taken back in
                _, drained = self._drain_requests()
                joined = [n for n in joined if (n, members[n]) not in drained]
            if joined:
                # A step boundary: newcomers are taken in from the next step on, which the
                # workers have barely begun when g+1 aborts it; the step just committed cost
                # nothing (a join never throws away a step's work, a loss may).
                self._detected = time.time()
                self._resolve_and_publish(g, record, in_flight, members, lost=[], joined=joined)
            return
        drains, _ = self._drain_requests()
        if drains:
            self._drain(g, record, in_flight, members, drains, boundary=decided is None)

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
                     node=req.node, id=req.id, reason=detail, generation=generation)  # fmt: skip
        log.warning("leader %s: drain %s %s: %s", self.who, req.id, state, detail)

    def _drain(self, g: int, record: GenerationRecord, in_flight: int, members: dict[int, int],
               requests: list[InjectionRequest], *, boundary: bool) -> None:  # fmt: skip
        for req in requests:
            if req.node not in record.plan.nodes or record.incarnations.get(req.node) != req.incarnation:
                self._answer(req, "refused", f"node {req.node} (incarnation {req.incarnation}) is not in "
                             f"generation {g} (nodes {sorted(record.plan.nodes)})")  # fmt: skip
                continue
            others = sorted(n for n in record.plan.nodes if n != req.node)
            f = record.plan.fault_tolerance
            try:
                plan = replan(self.tset, record.plan, others, global_microbatches=record.plan.global_microbatches,
                              fault_tolerance=f).plan  # fmt: skip
            except PlanningError as exc:
                self._answer(req, "refused", f"draining node {req.node} would leave nodes {others}, which cannot "
                             f"form the {f + 1} pipelines that fault tolerance {f} needs: {exc}")  # fmt: skip
                continue
            if not boundary:
                return  # at the next step boundary
            reason = f"drained node {req.node}: re-planned over nodes {others}"
            self._detected = time.time()
            if self._resolve_and_publish(g, record, in_flight, members, lost=[], joined=[], drained=[req.node],
                                         planned=(plan, reason)):  # fmt: skip
                self._answer(req, "done", reason, generation=g + 1)
            else:
                self._answer(req, "refused", "the job finished before a step boundary came")
            return

    def _in_flight(self, g: int, record: GenerationRecord) -> tuple[int, int, str | None]:
        """(first step of g not committed, ranks ready for it, its decision if any)."""
        decisions: dict[int, str] = {}
        ready: dict[int, int] = {}
        prefix = f"{self.rk.steps}{g}/"
        for value, meta in self.client.get_prefix(prefix):
            parts = meta.key.decode()[len(prefix) :].split("/")
            step = int(parts[0])
            if parts[1] == "decision":
                decisions[step] = value.decode()
            elif parts[1] == "ready":
                ready[step] = ready.get(step, 0) + 1
        step = record.resume_step if record.restore_checkpoint is None else record.restore_checkpoint
        while decisions.get(step) == COMMIT:
            step += 1
        return step, ready.get(step, 0), decisions.get(step)

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

    def _resolve_and_publish(self, g: int, record: GenerationRecord, in_flight: int,
                             members: dict[int, int], *, lost: list[int], joined: list[int],
                             drained: list[int] | None = None,
                             planned: tuple[Plan, str] | None = None) -> bool:  # fmt: skip
        """Publish g+1 (False: the job's last step was committed first). `planned`: its plan and reason."""
        # The in-flight step is decided before anyone moves on: abort, unless commit already won.
        resume = in_flight
        fence = self.election.leader_compare()
        if decide(self.client, self.rk, g, resume, ABORT, fence=fence) == COMMIT:
            resume += 1
            if resume >= self.config.spec.steps:
                self.finished.set()
                return False
            decide(self.client, self.rk, g, resume, ABORT, fence=fence)
        if planned is not None:
            plan, restore, reason = planned[0], None, planned[1]
        else:
            live = sorted(n for n, inc in members.items() if record.incarnations.get(n) == inc or n in joined)
            plan, restore, reason = self._plan_for(record.plan, live, lost=lost, joined=joined)
        new = GenerationRecord(
            plan=plan,
            resume_step=resume if restore is None else restore,
            incarnations={n: members[n] for n in plan.nodes},
            lost=lost,
            joined=joined,
            drained=drained or [],
            restore_checkpoint=restore,
            reason=reason,
            detected_at=self._detected,
            published_at=time.time(),
        )
        self.generations.publish(new.to_json(), expected=g, fence=self.election.leader_compare())
        self._detected = None
        log.warning("leader %s: published generation %d: %s", self.who, g + 1, reason)
        record_event(self.client, self.keys, who=self.who, kind="generation", generation=g + 1,
                     lost=lost, joined=joined, drained=drained or [], reason=reason,
                     restore_checkpoint=restore)  # fmt: skip
        return True

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
            gaps = [] if surviving_holders_cover(plan, set(live)) else [(-1, -1)]
        if not gaps:
            for f_now in range(f, -1, -1):
                try:
                    new = replan(self.tset, plan, live, global_microbatches=mbs, fault_tolerance=f_now).plan
                except PlanningError:
                    continue
                relaxed = "" if f_now == f else f"; fault tolerance relaxed from {f} to {f_now}"
                return new, None, f"{what}: re-planned over nodes {live}{relaxed}"
        from elastic.runtime.checkpoint import latest_complete

        spec = self.config.spec
        ckpt = latest_complete(Path(self.config.checkpoint_path), num_layers=plan.num_layers,
                               tp_degree=plan.gpus_per_node)  # fmt: skip
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
                ),
            )
        raise FallbackImpossible(f"{what}: no plan fits the live nodes {live} even with fault tolerance 0")
