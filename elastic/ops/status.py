"""`elastic status`: one consistent-enough snapshot of a job, read from etcd only.

`read_status(client, keys)` builds a `JobStatus`; `to_json()` and `render_table()` print it.
The JSON field names below are a contract for scripts (`schema_version` changes if one does):

    schema_version      1
    job, etcd           the job id and the etcd it was read from
    read_at             wall time of the read (Unix seconds)
    state               "starting" (no generation yet) | "running" | "finished" (every step
                        committed and every worker of the last plan done) | "failed" (the leader gave up)
    fatal               the leader's reason for giving up, or null
    leader              member id of the elected leader, or null
    generation          latest generation number (0 before the first is published)
    generation_reason   why that generation exists ("start", "lost [2]", ...), or null
    resume_step         0-based first step of that generation, or null
    committed_steps     steps committed so far (the `progress` record); the last committed
                        step is number `committed_steps` as `elastic run` prints it
    reported_steps      steps whose results were reported: the progress record carries the last
                        committed step's, so this equals committed_steps (kept for scripts)
    total_steps         steps the job runs, or null when the config is missing
    last_loss           loss of the last committed step, or null
    lease_ttl_s         lease TTL of the nodes (seconds), or null
    global_batch        samples per step; microbatch_size: samples per microbatch
    seq_len             tokens per sample (from the model preset), or null
    nodes               one object per node ever seen (members, plans, failure reports), by node:
        node              plan node number; member_id: its etcd member id ("node<k>")
        alive             whether its member key (on its lease) exists
        incarnation       its current (alive) or last known incarnation, or null
        lease_remaining_s seconds before its lease expires unless refreshed (alive only, else null)
        lease_granted_s   TTL the lease was granted with (alive only, else null)
        address, devices  from its member record (alive only, else null)
        pipeline, stage   its place in the latest plan, or null when it is not in it
        layers            [first, last) layers of that stage, or null
        failures          [{incarnation, reporter, reason, time}] from `failed/`, oldest first
        workers           [{local_rank, pid, transfer_address, incarnation}] registered now
        speed_factor      its busy time per unit of work over its peers' median (smoothed; null
                          when not measured: elastic/planning/stragglers.py)
        straggler         null, or its straggler mark: since_step, since (wall time), factor
        step_phases       null, or its seconds a step under the latest plan, each the median of the
                          straggler window: {forward, backward, wait} (wait: blocked on pipeline
                          peers; elastic/parallel/phase_clock.py)
        role              "active" (its incarnation is in the latest generation), "spare" (alive,
                          in no generation: a hot spare, elastic/planning/spares.py), "draining"
                          (drained by the latest generation, serving its shards before it leaves)
                          or "gone" (not alive)
    spares              node numbers whose role is "spare", ascending
    pipelines           the latest plan's pipelines:
        index             pipeline number; template: its stage count (the template's node count)
        nodes             node of each stage, in pipeline order
        stages            [{node, layers: [first, last)}]
        microbatches      microbatches of the global batch it processes per step
    throughput          null before two steps, else over the last `window_steps` committed steps
                        (at most the progress record's window of 8, fewer right after a re-plan):
        window_steps, tokens_per_step (global batch x seq_len),
        tokens_per_s      tokens of the window / wall time from the start of its first step to
                          the commit of its last (a recovery inside the window counts),
        mean_step_s, last_step_s   step wall times reported by the workers
    recoveries          number of reconfigurations (generations after the first)
    last_recovery       null, or the latest generation after the first, with the fields of
                        elastic.roles.progress.recovery_breakdown (generation, lost_nodes,
                        joined_nodes, drained_nodes, reason, restore_checkpoint, detected_at, published_at,
                        replayed_fraction, kept_microbatches, recomputed,
                        detecting_s, finishing_s, planning_s, transferring_s, rebuilding_s, replaying_s,
                        total_s, bytes_moved, bytes_moved_collective, fault_at, first_commit_at,
                        interrupted; the timing
                        fields are null until a worker has reported) and
        complete          every worker of that generation reported its timings (the numbers are final)
        workers_reported, workers_expected
    last_eval           null (no `--eval-every`, or none yet), or the latest validation loss (the
                        `eval` key, elastic/records/evals.py): step (steps committed when it ran),
                        loss, batches, generation, at, seconds
    checkpoint_failures null (no checkpoint save failed), or the failed checkpoint saves of the job
                        (a full or failing checkpoint disk; elastic/records/checkpoint_failures.py):
        count             failed saves, each counted once, over every worker
        last_step, last_reason, last_at, last_node, last_local_rank   the newest failure
    stragglers          null before the first record (or under --straggler-policy off), else the
                        `stragglers` record's policy, threshold, step and marked (node numbers)
    ended               null while the run is live (or read with --etcd); once the run in --run-dir has
                        ended, how (elastic/records/run_end.py; the other fields are the job's last status,
                        as its launcher read it at the end, or read back from a copy of its etcd's data):
        how               finished | stopped | failed | timed out | interrupted | terminated | exited |
                          crashed | launcher gone (no end was written: the launcher was killed?)
        detail, at, launcher_pid, source ("launcher" or "etcd copy")
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from elastic.coordinator.election import current_leader
from elastic.coordinator.etcd_api import EtcdClient, KVMetadata
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.coordinator.membership import NodeIdentity
from elastic.parallel.phase_clock import STEP_PHASES
from elastic.records.evals import EvalResult, eval_key
from elastic.records.generation import GenerationRecord
from elastic.records.job import shape_of_spec
from elastic.records.progress import ProgressRecord, read_progress
from elastic.records.recoveries import change_words, generation_fields, recovery_breakdown
from elastic.records.recovery_timings import RecoveryTimings
from elastic.records.run_end import RunEnd
from elastic.records.stragglers import StragglerRecord, read_stragglers
from elastic.records.workers import WorkerInfo, node_of
from templates.plan import Plan

SCHEMA_VERSION = 1
DEFAULT_WINDOW = 5
"""Committed steps the throughput is measured over (the progress record keeps up to 8)."""

_TIMING_FIELDS = (
    "detecting_s", "finishing_s", "planning_s", "transferring_s", "rebuilding_s", "replaying_s", "total_s",
    "bytes_moved", "bytes_moved_collective", "fault_at", "first_commit_at",
)


@dataclass(frozen=True, kw_only=True)
class FailureReport:
    """A failure report of `failed/<node>/<incarnation>`."""

    incarnation: int
    """Incarnation that was reported failed."""
    reporter: str
    """Member id of whoever reported it."""
    reason: str
    """Why, in words."""
    time: float
    """Wall time of the report."""


@dataclass(frozen=True, kw_only=True)
class WorkerStatus:
    """A worker registered under `workers/<node>/<local_rank>`."""

    local_rank: int
    """Its device index on the node."""
    pid: int
    """Its process id."""
    transfer_address: str
    """host:port of its shard server."""
    incarnation: int
    """Incarnation of its node."""


@dataclass(frozen=True, kw_only=True)
class NodeStatus:
    """One node as etcd knows it (module doc: `nodes`)."""

    node: int
    """Plan node number."""
    member_id: str
    """Its etcd member id."""
    alive: bool
    """Whether its member key exists."""
    incarnation: int | None
    """Current or last known incarnation."""
    lease_remaining_s: int | None
    """Seconds left on its lease (alive only)."""
    lease_granted_s: int | None
    """TTL its lease was granted with (alive only)."""
    address: str | None
    """host:port it serves peers on (alive only)."""
    devices: int | None
    """Its device count (alive only)."""
    pipeline: int | None
    """Pipeline of the latest plan it runs a stage of."""
    stage: int | None
    """That stage's index in the pipeline."""
    layers: tuple[int, int] | None
    """That stage's [first, last) layers."""
    failures: list[FailureReport] = field(default_factory=list)
    """Failure reports about it, oldest first."""
    workers: list[WorkerStatus] = field(default_factory=list)
    """Its workers registered now, by local rank."""
    role: str = "active"
    """"active", "spare", "draining" or "gone" (module doc: `role`)."""
    speed_factor: float | None = None
    """Its smoothed speed factor against its peers (module doc)."""
    straggler: dict[str, Any] | None = None
    """Its straggler mark, or None."""
    step_phases: dict[str, float] | None = None
    """Its forward, backward and wait seconds a step (module doc), or None."""


@dataclass(frozen=True, kw_only=True)
class StageStatus:
    """One stage of a pipeline."""

    node: int
    """Node that runs it."""
    layers: tuple[int, int]
    """Its [first, last) layers."""


@dataclass(frozen=True, kw_only=True)
class PipelineStatus:
    """One pipeline of the latest plan."""

    index: int
    """Pipeline number."""
    template: int
    """Stage count, i.e. the node count of the template it instantiates."""
    nodes: list[int]
    """Node of each stage, in pipeline order."""
    stages: list[StageStatus]
    """Its stages, in pipeline order."""
    microbatches: int
    """Microbatches of the global batch it runs per step."""


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """Training speed over the last reported steps."""

    window_steps: int
    """Steps in the window."""
    tokens_per_step: int
    """Global batch x sequence length."""
    tokens_per_s: float
    """Window tokens over the window's wall time (start of its first step to commit of its last)."""
    mean_step_s: float
    """Mean reported step time of the window."""
    last_step_s: float
    """Reported time of the last step."""


@dataclass(frozen=True, kw_only=True)
class JobStatus:
    """A snapshot of one job (module doc: the JSON contract)."""

    job: str
    etcd: str
    read_at: float
    state: str
    fatal: str | None
    leader: str | None
    generation: int
    generation_reason: str | None
    resume_step: int | None
    committed_steps: int
    reported_steps: int
    total_steps: int | None
    last_loss: float | None
    lease_ttl_s: int | None
    global_batch: int | None
    microbatch_size: int | None
    seq_len: int | None
    nodes: list[NodeStatus]
    pipelines: list[PipelineStatus]
    throughput: Throughput | None
    recoveries: int
    last_recovery: dict[str, Any] | None
    last_eval: dict[str, Any] | None = None
    checkpoint_failures: dict[str, Any] | None = None
    spares: list[int] = field(default_factory=list)
    stragglers: dict[str, Any] | None = None
    ended: dict[str, Any] | None = None
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, *, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)


# ---- reading -------------------------------------------------------------------------------


def _key_tail(meta: KVMetadata, prefix: str) -> list[str]:
    return str(meta.key.decode())[len(prefix) :].split("/")


def _config(client: EtcdClient, rk: RunKeys) -> dict[str, Any] | None:
    value, _ = client.get(rk.config)
    return json.loads(value) if value is not None else None


def _generations(client: EtcdClient, keys: JobKeys) -> dict[int, GenerationRecord]:
    return {
        int(_key_tail(meta, keys.plans)[0]): GenerationRecord.from_json(value)
        for value, meta in client.get_prefix(keys.plans)
    }


def _throughput(record: ProgressRecord | None, tokens_per_step: int, window: int) -> Throughput | None:
    """Throughput over the last `window` steps of the progress record's window of recent steps
    ([step, committed_at, seconds] each, oldest first)."""
    recent = record.recent[-window:] if record is not None else []
    if len(recent) < 2:
        return None
    (_, first_at, first_s), (_, last_at, last_s) = recent[0], recent[-1]
    wall = last_at - first_at + first_s
    return Throughput(
        window_steps=len(recent),
        tokens_per_step=tokens_per_step,
        tokens_per_s=tokens_per_step * len(recent) / wall if wall > 0 else 0.0,
        mean_step_s=sum(seconds for _, _, seconds in recent) / len(recent),
        last_step_s=last_s,
    )


def _last_recovery(
    client: EtcdClient, rk: RunKeys, generations: dict[int, GenerationRecord]
) -> dict[str, Any] | None:
    later = [g for g in generations if g > 1]
    if not later:
        return None
    g = max(later)
    rec = generations[g]
    expected = len(rec.plan.nodes) * rec.plan.gpus_per_node
    timings = [RecoveryTimings.from_json(v) for v, _ in client.get_prefix(rk.prefix("recoveries", g))]
    if timings:
        entry = recovery_breakdown(client, rk, g, rec, timings)
    else:
        entry = {**generation_fields(g, rec), **dict.fromkeys(_TIMING_FIELDS), "interrupted": False}
    return {**entry, "complete": len(timings) >= expected, "workers_reported": len(timings),
            "workers_expected": expected}


def _lease(client: EtcdClient, lease_id: int) -> tuple[int | None, int | None]:
    if not lease_id:
        return None, None
    info = client.get_lease_info(lease_id)
    return (int(info.TTL), int(info.grantedTTL)) if info.TTL >= 0 else (None, None)


def read_status(client: EtcdClient, keys: JobKeys, *, etcd: str, window: int = DEFAULT_WINDOW) -> JobStatus:
    """Read everything `elastic status` shows of job `keys` (etcd errors propagate)."""
    if window < 2:
        raise ValueError(f"the throughput window must be >= 2 steps, got {window}")
    rk = RunKeys(keys)
    read_at = time.time()
    config = _config(client, rk)
    generations = _generations(client, keys)
    g = max(generations, default=0)
    rec = generations.get(g)
    plan = rec.plan if rec is not None else None
    speeds = read_stragglers(client, keys)
    nodes = _with_speeds(_with_roles(_read_nodes(client, keys, generations, plan), generations), speeds)
    progress = read_progress(client, rk)
    committed = 0 if progress is None else progress.step + 1
    spec = config["spec"] if config is not None else None
    seq_len = shape_of_spec(spec).seq_len if spec is not None else None
    tokens = plan.global_batch * seq_len if plan is not None and seq_len is not None else None
    fatal_value, _ = client.get(keys.fatal)
    fatal = fatal_value.decode() if fatal_value is not None else None
    total = int(spec["steps"]) if spec is not None else None
    return JobStatus(
        job=keys.job,
        etcd=etcd,
        read_at=read_at,
        state=_state(client, rk, fatal=fatal, plan=plan, total=total, committed=committed),
        fatal=fatal,
        leader=current_leader(client, keys),
        generation=g,
        generation_reason=rec.reason if rec is not None else None,
        resume_step=rec.resume_step if rec is not None else None,
        committed_steps=committed,
        reported_steps=committed,
        total_steps=total,
        last_loss=progress.loss if progress is not None else None,
        lease_ttl_s=int(config["lease_ttl"]) if config is not None else None,
        global_batch=plan.global_batch if plan is not None else None,
        microbatch_size=plan.microbatch_size if plan is not None else None,
        seq_len=seq_len,
        nodes=nodes,
        pipelines=_pipelines(plan),
        throughput=_throughput(progress, tokens, window) if tokens is not None else None,
        recoveries=sum(1 for n in generations if n > 1),
        last_recovery=_last_recovery(client, rk, generations),
        last_eval=_last_eval(client, keys),
        checkpoint_failures=_checkpoint_failures(client, keys),
        spares=[n.node for n in nodes if n.role == "spare"],
        stragglers=None if speeds is None else {
            "policy": speeds.policy, "threshold": speeds.threshold, "step": speeds.step, "marked": sorted(speeds.marked)},
    )


def _with_speeds(nodes: list[NodeStatus], speeds: StragglerRecord | None) -> list[NodeStatus]:
    """`nodes` with their speed factors and straggler marks (the `stragglers` record)."""
    if speeds is None:
        return nodes
    return [dataclasses.replace(n, speed_factor=speeds.factors.get(n.node), straggler=None
                                if n.node not in speeds.marked else dataclasses.asdict(speeds.marked[n.node]),
                                step_phases=None if n.node not in speeds.phases else
                                dict(zip(STEP_PHASES, speeds.phases[n.node], strict=True)))
            for n in nodes]


def _checkpoint_failures(client: EtcdClient, keys: JobKeys) -> dict[str, Any] | None:
    """The job's failed checkpoint saves (one record per worker that had one), or None."""
    from elastic.records.checkpoint_failures import SaveFailures, save_failures_prefix

    records = [SaveFailures.from_json(value) for value, _ in client.get_prefix(save_failures_prefix(keys))]
    if not records:
        return None
    last = max(records, key=lambda r: r.last_at)
    return {"count": sum(r.count for r in records), "last_step": last.last_step, "last_reason": last.last_reason,
            "last_at": last.last_at, "last_node": last.node, "last_local_rank": last.local_rank}


def _with_roles(nodes: list[NodeStatus], generations: dict[int, GenerationRecord]) -> list[NodeStatus]:
    """`nodes` with their role (module doc: `role`) as the latest generation says."""
    g = max(generations, default=0)
    rec, before = generations.get(g), generations.get(g - 1)
    if rec is None:  # before generation 1 every live node is on its way in
        return nodes
    out = []
    for n in nodes:
        if not n.alive:
            role = "gone"
        elif rec.incarnations.get(n.node) == n.incarnation:
            role = "active"
        elif n.node in rec.drained and before is not None and before.incarnations.get(n.node) == n.incarnation:
            role = "draining"
        else:
            role = "spare"
        out.append(dataclasses.replace(n, role=role))
    return out


def _last_eval(client: EtcdClient, keys: JobKeys) -> dict[str, Any] | None:
    """The latest evaluation (one key read), or None."""
    value, _ = client.get(eval_key(keys))
    return None if value is None else EvalResult.from_json(value).to_dict()


def _state(client: EtcdClient, rk: RunKeys, *, fatal: str | None, plan: Plan | None, total: int | None,
           committed: int) -> str:
    """The job's state (module doc: `state`); reads the done keys only once every step is committed."""
    if fatal is not None:
        return "failed"
    if plan is None:
        return "starting"
    if total is not None and committed >= total and _all_done(client, rk, plan.nodes, plan.gpus_per_node):
        return "finished"
    return "running"


def _read_nodes(
    client: EtcdClient, keys: JobKeys, generations: dict[int, GenerationRecord], plan: Plan | None
) -> list[NodeStatus]:
    """Every node ever seen (a member, a failure report, a node of any plan), by node number."""
    members = _members(client, keys)
    failures = _failures(client, keys)
    workers = _workers(client, RunKeys(keys))
    known = set(members) | set(failures) | {n for r in generations.values() for n in r.plan.nodes}
    nodes = []
    for node in sorted(known):
        entry = members.get(node)
        ident, lease_id = entry if entry is not None else (None, 0)
        remaining, granted = _lease(client, lease_id) if ident is not None else (None, None)
        last_inc = max([r.incarnation for r in failures.get(node, [])]
                       + [r.incarnations[node] for r in generations.values() if node in r.incarnations],
                       default=None)
        place = _place(plan, node)
        nodes.append(
            NodeStatus(
                node=node,
                member_id=f"node{node}",
                alive=ident is not None,
                incarnation=ident.incarnation if ident is not None else last_inc,
                lease_remaining_s=remaining,
                lease_granted_s=granted,
                address=ident.address if ident is not None else None,
                devices=ident.devices if ident is not None else None,
                pipeline=place[0] if place else None,
                stage=place[1] if place else None,
                layers=place[2] if place else None,
                failures=sorted(failures.get(node, []), key=lambda r: r.time),
                workers=sorted(workers.get(node, []), key=lambda w: w.local_rank),
            )
        )
    return nodes


def _members(client: EtcdClient, keys: JobKeys) -> dict[int, tuple[NodeIdentity, int]]:
    """Node -> its member record and the id of the lease it is on (members alive now)."""
    members: dict[int, tuple[NodeIdentity, int]] = {}
    for value, meta in client.get_prefix(keys.members):
        member = NodeIdentity.from_json(value)
        members[node_of(member.node_id)] = (member, meta.lease_id)
    return members


def _failures(client: EtcdClient, keys: JobKeys) -> dict[int, list[FailureReport]]:
    """Node -> the failure reports about it (`failed/<member>/<incarnation>`), in etcd's key order."""
    failures: dict[int, list[FailureReport]] = {}
    for value, meta in client.get_prefix(keys.failed):
        member_id, inc = _key_tail(meta, keys.failed)[:2]
        data = json.loads(value)
        report = FailureReport(incarnation=int(inc), reporter=str(data["reporter"]), reason=str(data["reason"]),
                               time=float(data["time"]))
        failures.setdefault(node_of(member_id), []).append(report)
    return failures


def _workers(client: EtcdClient, rk: RunKeys) -> dict[int, list[WorkerStatus]]:
    """Node -> its workers registered now (`workers/<node>/<local_rank>`), in etcd's key order."""
    workers: dict[int, list[WorkerStatus]] = {}
    for value, meta in client.get_prefix(rk.workers):
        node, local_rank = (int(x) for x in _key_tail(meta, rk.workers)[:2])
        info = WorkerInfo.from_json(value)
        workers.setdefault(node, []).append(WorkerStatus(local_rank=local_rank, pid=info.pid,
                                            transfer_address=info.transfer_address, incarnation=info.incarnation))
    return workers


def _pipelines(plan: Plan | None) -> list[PipelineStatus]:
    """The pipelines of `plan` (none without a plan)."""
    if plan is None:
        return []
    pipelines = []
    for p, pipe in enumerate(plan.pipelines):
        stages = [StageStatus(node=s.node, layers=s.layers) for s in pipe.stages]
        pipelines.append(PipelineStatus(index=p, template=len(stages), nodes=list(pipe.nodes),
                                        stages=stages, microbatches=pipe.microbatches))
    return pipelines


def _place(plan: Plan | None, node: int) -> tuple[int, int, tuple[int, int]] | None:
    if plan is None:
        return None
    for p, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            if stage.node == node:
                return p, s, stage.layers
    return None


def _all_done(client: EtcdClient, rk: RunKeys, nodes: tuple[int, ...], gpus: int) -> bool:
    done = {
        tuple(int(x) for x in _key_tail(meta, rk.done)[:2])
        for _, meta in client.get_prefix(rk.done, keys_only=True)
    }
    return all((n, r) in done for n in nodes for r in range(gpus))


# ---- rendering -----------------------------------------------------------------------------


def _ago(t: float | None, now: float) -> str:
    return "-" if t is None else f"{now - t:.1f} s ago"


def _layers(layers: tuple[int, int] | list[int] | None) -> str:
    return "-" if layers is None else f"[{layers[0]},{layers[1]})"


def _recovery_line(r: dict[str, Any]) -> str:
    change = change_words(r["lost_nodes"], r["joined_nodes"], r.get("drained_nodes", []))
    head = f"generation {r['generation']} ({change})"
    if r["total_s"] is None:
        return f"{head}: in progress, no worker has reported yet"
    line = (
        f"{head}: total {r['total_s']:.2f} s = detect {r['detecting_s']:.2f} + finish {r['finishing_s']:.2f} "
        f"+ plan {r['planning_s']:.2f} "
        f"+ transfer {r['transferring_s']:.2f} + rebuild {r['rebuilding_s']:.2f} + replay {r['replaying_s']:.2f}; "
        f"{r['bytes_moved']} bytes moved"
    )
    if r.get("replayed_fraction") is not None:
        line += f"; replayed {r['replayed_fraction']:.0%} of the interrupted step"
    if r["restore_checkpoint"] is not None:
        line += f"; restored the checkpoint of step {r['restore_checkpoint']}"
    if not r["complete"]:
        line += f" (so far: {r['workers_reported']}/{r['workers_expected']} workers reported)"
    return line


def _ended_line(ended: dict[str, Any]) -> str:
    """The first line of an ended run's table: how it ended, and that what follows is its last status."""
    end = RunEnd.from_dict(ended)
    when = "" if end.at is None else time.strftime(" at %Y-%m-%d %H:%M:%S", time.localtime(end.at))
    return f"{end.describe()}{when}; its last status:"


def render_table(status: JobStatus) -> str:
    """The snapshot as a few lines and two tables, for people."""
    s = status
    total = "?" if s.total_steps is None else str(s.total_steps)
    lines = [
        f"job {s.job} at etcd {s.etcd}: {s.state}" + (f" ({s.fatal})" if s.fatal else "")
        + f", leader {s.leader or '-'}",
        f"generation {s.generation}" + (f" ({s.generation_reason}, from step {s.resume_step + 1})"
                                        if s.resume_step is not None else "")
        + f"; committed {s.committed_steps}/{total} steps"
        + (f", last loss {s.last_loss:.4f}" if s.last_loss is not None else ""),
    ]
    if s.ended is not None:
        lines.insert(0, _ended_line(s.ended))
    if s.last_eval is not None:
        e = s.last_eval
        lines.append(f"validation loss {e['loss']:.4f} after step {e['step']} ({e['batches']} held-out batches, "
                     f"generation {e['generation']})")
    if s.checkpoint_failures is not None:
        c = s.checkpoint_failures
        lines.append(f"checkpoint saves failed: {c['count']}; last: step {c['last_step']} on node {c['last_node']} "
                     f"({_ago(c['last_at'], s.read_at)}): {c['last_reason']}")
    if s.spares:
        lines.append("hot spares: " + ", ".join(
            f"node {n.node} (incarnation {n.incarnation})" for n in s.nodes if n.role == "spare"))
    marked = [n for n in s.nodes if n.straggler is not None]
    if marked:
        lines.append("stragglers: " + ", ".join(
            f"node {n.node} ({n.straggler['factor']:.2f}x its peers, since step {n.straggler['since_step'] + 1})"
            for n in marked if n.straggler is not None))
    if s.throughput is not None:
        t = s.throughput
        lines.append(
            f"throughput {t.tokens_per_s:.0f} tokens/s over the last {t.window_steps} steps "
            f"(mean step {t.mean_step_s:.3f} s, last {t.last_step_s:.3f} s, {t.tokens_per_step} tokens/step)"
        )
    lines += ["", f"{'node':>4}  {'alive':<5}  {'inc':>3}  {'lease':>5}  {'address':<21}  {'pipe/stage':<10}  "
                  f"{'layers':<7}  {'speed':<6}  {'f/b/wait ms':<14}  {'workers (rank:pid@transfer)':<30}  failures"]
    for n in s.nodes:
        lease = "-" if n.lease_remaining_s is None else f"{n.lease_remaining_s}/{n.lease_granted_s}s"
        place = "-" if n.pipeline is None else f"{n.pipeline}/{n.stage}"
        workers = " ".join(f"{w.local_rank}:{w.pid}@{w.transfer_address}" for w in n.workers) or "-"
        fails = "; ".join(f"inc {f.incarnation} by {f.reporter}: {f.reason} ({_ago(f.time, s.read_at)})"
                          for f in n.failures) or "-"
        inc = "-" if n.incarnation is None else str(n.incarnation)
        speed = "-" if n.speed_factor is None else f"{n.speed_factor:.2f}" + ("!" if n.straggler else "")
        ph = n.step_phases
        phases = "-" if ph is None else "/".join(f"{ph[k] * 1e3:.0f}" for k in STEP_PHASES)
        lines.append(
            f"{n.node:>4}  {'yes' if n.alive else 'NO':<5}  {inc:>3}  {lease:>5}  {n.address or '-':<21}  "
            f"{place:<10}  {_layers(n.layers):<7}  {speed:<6}  {phases:<14}  {workers:<30}  {fails}"
        )
    if s.pipelines:
        lines += ["", f"{'pipe':>4}  {'template':>8}  {'mbs':>4}  stages (node:[layers))"]
        for p in s.pipelines:
            stages = " ".join(f"{st.node}:{_layers(st.layers)}" for st in p.stages)
            lines.append(f"{p.index:>4}  {p.template:>8}  {p.microbatches:>4}  {stages}")
    lines.append("")
    if s.last_recovery is None:
        lines.append("recoveries: none")
    else:
        lines.append(f"recoveries: {s.recoveries}; last: {_recovery_line(s.last_recovery)}")
    return "\n".join(lines)
