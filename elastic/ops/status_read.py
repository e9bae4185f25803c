"""`elastic status`'s read: one snapshot of a job (a `JobStatus`, elastic/ops/status.py) from its
etcd keys alone: members and leases, failure reports, registered workers, the generations and their
plans, the progress record, recovery timings, evaluations, failed checkpoint saves and the
stragglers record. Every read is a get or a prefix scan of an operator command, never of the step loop."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from elastic.coordinator.election import current_leader
from elastic.coordinator.etcd_api import EtcdClient, KVMetadata
from elastic.coordinator.jsonrecord import unpack_text
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.coordinator.membership import NodeIdentity
from elastic.ops.status import (
    FailureReport,
    JobStatus,
    NodeStatus,
    PipelineStatus,
    StageStatus,
    Throughput,
    WorkerStatus,
)
from elastic.parallel.phase_clock import STEP_PHASES
from elastic.records.evals import EvalResult, eval_key
from elastic.records.generation import GenerationRecord
from elastic.records.job import shape_of_spec
from elastic.records.node_workers import read_registrations
from elastic.records.progress import ProgressRecord, read_progress
from elastic.records.recoveries import generation_fields, recovery_breakdown
from elastic.records.recovery_timings import RecoveryTimings, workers_reported
from elastic.records.stragglers import StragglerRecord, read_stragglers
from elastic.records.suspicion import read_suspicion
from elastic.records.workers import node_of
from templates.plan import Plan

DEFAULT_WINDOW = 5
"""Committed steps the throughput is measured over (the progress record keeps up to 8)."""

_TIMING_FIELDS = (
    "detecting_s", "finishing_s", "planning_s", "transferring_s", "rebuilding_s", "replaying_s", "total_s",
    "bytes_moved", "bytes_moved_collective", "fault_at", "first_commit_at",
)


def _key_tail(meta: KVMetadata, prefix: str) -> list[str]:
    return str(meta.key.decode())[len(prefix) :].split("/")


def _config(client: EtcdClient, rk: RunKeys) -> dict[str, Any] | None:
    value, _ = client.get(rk.config)
    return json.loads(unpack_text(value)) if value is not None else None


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
    reported = workers_reported(timings)
    return {**entry, "complete": reported >= expected, "workers_reported": reported,
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
        suspicion=_suspicion(client, keys),
        stragglers=None if speeds is None else {
            "policy": speeds.policy, "threshold": speeds.threshold, "step": speeds.step, "marked": sorted(speeds.marked)},
    )


def _suspicion(client: EtcdClient, keys: JobKeys) -> dict[str, Any] | None:
    """The leader's latest verdict on expired leases (elastic/records/suspicion.py), or None."""
    record = read_suspicion(client, keys)
    return None if record is None else record.to_dict()


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
    """`nodes` with their role (elastic/ops/status.py's doc: `role`) as the latest generation says."""
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
    """The job's state (elastic/ops/status.py's doc: `state`); reads the done keys only once every step is committed."""
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
    """Node -> its workers registered now (records/node_workers.py: either form), by local rank."""
    workers: dict[int, list[WorkerStatus]] = {}
    for (node, local_rank), info in read_registrations(client, rk).items():
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

