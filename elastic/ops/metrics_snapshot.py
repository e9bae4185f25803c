"""What a node's metrics endpoint serves, as numbers: a `Snapshot` computed from the mirrored etcd
state at scrape time (nothing counted locally), its finished recoveries by the breakdown of
elastic.roles.launcher_feed, and the hot spares among the live members. Metric names: metrics.py's doc."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psutil

from elastic.coordinator.membership import NodeIdentity
from elastic.records.evals import EvalResult
from elastic.records.generation import GenerationRecord
from elastic.records.progress import ProgressRecord
from elastic.records.recoveries import breakdown_of
from elastic.records.recovery_timings import SUMMARY_NODE, RecoveryTimings, distinct, workers_reported
from elastic.records.workers import WorkerInfo, node_of

PHASES = ("detecting", "planning", "transferring", "rebuilding", "replaying")
"""The recovery phases the endpoint serves (elastic_last_recovery_phase_seconds)."""


def spare_members(members: dict[str, Any], plans: dict[str, GenerationRecord]) -> set[int]:
    """Nodes of the live `members` (raw member records) whose incarnation the latest of `plans`
    does not include: the hot spares (none before generation 1)."""
    if not plans:
        return set()
    latest = plans[max(plans, key=int)]
    out = set()
    for raw in members.values():
        try:
            ident = NodeIdentity.from_json(raw)
            node = node_of(ident.node_id)
        except (ValueError, TypeError, KeyError):
            continue
        if latest.incarnations.get(node) != ident.incarnation:
            out.add(node)
    return out


@dataclass(frozen=True, kw_only=True)
class Recovery:
    """A finished recovery as the metrics see it (the fields of the summary's recovery entry)."""

    generation: int
    """Generation it recovered into."""
    total_s: float
    """Fault (or detection) to the first commit."""
    phases: dict[str, float]
    """Seconds per phase, keys PHASES."""


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """Every value the endpoint serves, computed from the mirrored etcd state (names: metrics.py's doc)."""

    step: int = 0
    """elastic_step."""
    loss: float | None = None
    """elastic_loss (None: no step committed yet)."""
    step_seconds: float | None = None
    """elastic_step_seconds."""
    tokens_per_s: float | None = None
    """elastic_tokens_per_second (None: no step yet, or the job config not read)."""
    generation: int = 0
    """elastic_generation."""
    recoveries: int = 0
    """elastic_recoveries_total."""
    finished: list[Recovery] = field(default_factory=list)
    """Finished recoveries by generation: the last one's gauges and the histogram."""
    node_bytes: int = 0
    """elastic_transfer_bytes_total."""
    job_bytes: int = 0
    """elastic_job_transfer_bytes_total."""
    workers: int = 0
    """elastic_workers."""
    workers_alive: int = 0
    """elastic_workers_alive."""
    nodes_alive: int = 0
    """elastic_nodes_alive."""
    eval_loss: float | None = None
    """elastic_eval_loss (None: no evaluation yet)."""
    eval_step: int | None = None
    """elastic_eval_step."""
    checkpoint_save_failures: int = 0
    """elastic_checkpoint_save_failures_total."""
    spares: int = 0
    """elastic_spares."""
    node_spare: bool = False
    """elastic_node_spare."""
    suspects_cleared: int = 0
    """elastic_suspects_cleared_total."""


def recovery_of(
    g: int, rec: GenerationRecord, timings: list[RecoveryTimings], injected: dict[str, float]
) -> Recovery:
    """The breakdown of elastic.roles.launcher_feed (the launcher's and `elastic status`'s), from
    mirrored values."""
    b = breakdown_of(g, rec, timings, list(injected.items()))
    return Recovery(generation=g, total_s=b["total_s"], phases={p: b[f"{p}_s"] for p in PHASES})


def _alive(pid: int) -> bool:
    try:
        status = psutil.Process(pid).status()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return status not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def snapshot(
    *,
    node: int,
    seq_len: int | None,
    window: int,
    plans: dict[int, GenerationRecord],
    progress: ProgressRecord | None,
    timings: dict[int, dict[int, RecoveryTimings]],
    injected: dict[str, float],
    workers: list[WorkerInfo],
    nodes_alive: int,
    last_eval: EvalResult | None = None,
    save_failures: int = 0,
) -> Snapshot:
    """What the endpoint serves for plan node `node`, given the job's state (see metrics.py's doc).

    `progress` is the job's progress record (None before the first commit); `seq_len` None (the
    job config not read yet) leaves tokens/s out; `last_eval` is the `eval` key (None: none yet);
    `save_failures` the job's failed checkpoint saves (the counts of `checkpoint-failures/`)."""
    last = progress
    tokens_per_s = None
    if last is not None and seq_len and last.generation in plans:
        tokens_per_s = _tokens_per_s(last, plans[last.generation].plan.global_batch * seq_len, window)
    finished: list[Recovery] = []
    node_bytes = job_bytes = 0
    for g, rec in sorted(plans.items()):
        got = timings.get(g, {})  # by node, the generation's summary under SUMMARY_NODE once folded
        world = len(rec.plan.nodes) * rec.plan.gpus_per_node
        job_bytes += sum(t.reconfig.bytes_fetched for t in distinct(list(got.values())))
        node_bytes += _node_bytes(got, node)
        superseded = any(later > g for later in plans)
        if g > 1 and got and (workers_reported(list(got.values())) >= world or superseded):
            finished.append(recovery_of(g, rec, list(got.values()), injected))
    return Snapshot(
        step=last.step + 1 if last else 0,
        loss=last.loss if last else None,
        step_seconds=last.seconds if last else None,
        tokens_per_s=tokens_per_s,
        generation=max(plans, default=0),
        recoveries=sum(1 for g in plans if g > 1),
        finished=finished,
        node_bytes=node_bytes,
        job_bytes=job_bytes,
        workers=len(workers),
        workers_alive=sum(1 for w in workers if _alive(w.pid)),
        nodes_alive=nodes_alive,
        eval_loss=None if last_eval is None else last_eval.loss,
        eval_step=None if last_eval is None else last_eval.step,
        checkpoint_save_failures=save_failures,
    )


def _node_bytes(got: dict[int, RecoveryTimings], node: int) -> int:
    """Bytes node `node` fetched into a generation: its own record's, else its generation summary's
    count (a record the summary covers is counted once)."""
    summary = got.get(SUMMARY_NODE)
    own = got.get(node)
    if own is not None and (summary is None or not set(own.ranks) <= set(summary.ranks)):
        return own.reconfig.bytes_fetched + (0 if summary is None else summary.node_bytes.get(node, 0))
    return 0 if summary is None else summary.node_bytes.get(node, 0)


def _tokens_per_s(record: ProgressRecord, tokens: int, window: int) -> float | None:
    """Tokens per second over the last `window` steps of the record's recent window (commit to
    commit), or of its last step alone when the window holds one."""
    recent = record.recent[-window:]
    span = recent[-1][1] - recent[0][1] if recent else 0.0
    if len(recent) >= 2 and span > 0:
        return tokens * (len(recent) - 1) / span
    return tokens / record.seconds if record.seconds > 0 else None
