"""`elastic status`: one consistent-enough snapshot of a job, read from etcd only.

This file holds the snapshot's records (`JobStatus` and its parts) and its JSON view: `read_status`
(status_read.py) builds a `JobStatus` from etcd, `to_json()` prints it for scripts and `render_table`
(status_table.py) for people. The JSON field names below are a contract for scripts
(`schema_version` changes if one does):

    schema_version      1
    job, etcd           the job id and the etcd it was read from
    read_at             wall time of the read (Unix seconds)
    state               "starting" (no generation yet) | "running" | "finished" (every step
                        committed and every worker of the last plan done) | "failed" (the leader gave up)
    fatal               the leader's reason for giving up, or null
    suspicion           the leader's latest verdict on nodes whose lease expired, or null:
                        {at, suspects, answered, silent, mass, stalled, decision, probe_s,
                        cleared_total} (elastic/records/suspicion.py); decision "kept",
                        "control-plane stall: no change" or "lost"
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
                        elastic.records.recoveries.recovery_breakdown (generation, lost_nodes,
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

import json
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA_VERSION = 1


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
    """A worker registered in `workers/<node>/all` (or, in the older form, `workers/<node>/<local_rank>`)."""

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
    suspicion: dict[str, Any] | None = None
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, *, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)
