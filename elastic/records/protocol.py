"""The etcd keys and records of an elastic run: what launcher, agents, leader and workers share.

Everything lives under the job's prefix `/elastic/<job>/` (see elastic/coordinator/keys.py for
members, failed/, suspects/, leader, generation, plan/, injections/, events/, token, rdzv/, store/):

    config                          ElasticConfig JSON: the job spec, planning inputs, injections
    workers/<node>/<local_rank>     {"pid", "transfer_address", "incarnation"} on the node's lease
    holdings/<node>/<local_rank>    [[layer, tp_rank], ...] the worker held when it last halted (written
                                    with its sync report, in one transaction), on the node's lease
    plan/<g>                        GenerationRecord JSON (published with Generations.publish)
    progress                        ProgressRecord of the last committed step (world rank 0, one put a step)
    stragglers                      StragglerRecord: speed factors and straggler marks (world rank 0, on a
                                    change and at most every second otherwise; records/stragglers.py)
    straggler-policy                PolicyOverride: the operator's change of the straggler settings
                                    (`elastic stragglers`); read about once a second by world rank 0
                                    and the leader
    halt/<g>                        HaltRecord: the leader asks generation g to stop (abort now, or at
                                    the next step boundary); written once per generation change, and
                                    once more with `stop_step` when the whole job stops (records/stop.py)
    stop                            StopRequest: stop the whole job at a step boundary with a checkpoint
    sync/<g>/<node>/<local_rank>    SyncReport of a worker of g once it halted (what it committed)
    ready/<g>/<s>/<rank>            the job's last step s only: a worker's vote succeeded
    decisions/<g>/<s>               the job's last step s only: "commit" | "abort", created once by the leader
    recoveries/<g>/<rank>           RecoveryTimings: a worker's reconfiguration into g (one flat object)
    done/<node>/<local_rank>        a worker finished every step and saved its outputs ("stopped": its
                                    checkpoint shards of a whole-job stop are on disk)
    injected/<name>                 when an injection (request id <name>) was carried out (wall time)
    injections/<id>                 InjectionRequest JSON (see injection.py), from the CLI or the launcher
    injection-status/<id>           InjectionStatus JSON: running, done, refused or fenced

Node ids in etcd are `node<k>` for plan node k; a node's incarnation counts its (re)starts.
Every JSON record here is a `JsonRecord` (elastic/coordinator/jsonrecord.py): its JSON comes from
its fields and carries the schema version `"v"` (a record without one is version 1).

The failure-free step path touches etcd once per step (the `progress` put, off the critical
path): every worker commits a step when the step's world all-reduce (the vote: gradient norm,
loss, ok and halt flags) completes. Generation changes go through `halt/`, `sync/` and the next
`plan/<g>` (see leader.py); only the job's last step is decided through etcd (`ready/`,
`decisions/`), so that no worker finishes the job while another replays its last step.
Per-step results (loss, norm, lr, seconds) are appended by each pipeline's first worker to its
local log `<run_dir>/steps/node<N>.worker<L>.jsonl` (see `step_log_path`), which the summary
reads at the end; etcd keeps no per-step history.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.jsonrecord import INLINE, JsonRecord, RecordError
from elastic.coordinator.keys import JobKeys
from elastic.coordinator.membership import read_members
from elastic.planning.cluster import ClusterSpec
from elastic.planning.stragglers import StragglerConfig
from elastic.records.injection import Injection
from elastic.records.job import JobSpec
from elastic.records.partial import PartialReport, ReplayRecord
from elastic.records.resume import ResumeSource
from templates.plan import Plan

COMMIT = "commit"
ABORT = "abort"


def node_id(node: int) -> str:
    """The etcd member id of plan node `node`."""
    return f"node{node}"


def node_of(member_id: str) -> int:
    """Plan node number of member id `node<k>`; ValueError for another form."""
    if not member_id.startswith("node") or not member_id[4:].isdigit():
        raise ValueError(f"member id {member_id!r} is not of the form node<k>")
    return int(member_id[4:])


def live_nodes(client: EtcdClient, keys: JobKeys) -> dict[int, int]:
    """Plan node -> incarnation of every live member of the job (members of another form skipped)."""
    out = {}
    for member_id, ident in read_members(client, keys)[0].items():
        try:
            out[node_of(member_id)] = ident.incarnation
        except ValueError:
            continue
    return out


@dataclass(frozen=True)
class RunKeys:
    """Keys of the elastic runtime, beside the coordinator's JobKeys of the same job."""

    job: JobKeys

    @property
    def config(self) -> str:
        return self.job.root + "config"

    @property
    def workers(self) -> str:
        return self.job.root + "workers/"

    def worker(self, node: int, local_rank: int) -> str:
        return f"{self.workers}{node}/{local_rank}"

    def node_workers(self, node: int) -> str:
        return f"{self.workers}{node}/"

    @property
    def holdings(self) -> str:
        return self.job.root + "holdings/"

    def worker_holdings(self, node: int, local_rank: int) -> str:
        return f"{self.holdings}{node}/{local_rank}"

    @property
    def progress(self) -> str:
        return self.job.root + "progress"

    @property
    def halts(self) -> str:
        return self.job.root + "halt/"

    def halt(self, generation: int) -> str:
        return f"{self.halts}{generation}"

    @property
    def syncs(self) -> str:
        return self.job.root + "sync/"

    def sync(self, generation: int) -> str:
        return f"{self.syncs}{generation}/"

    def sync_report(self, generation: int, node: int, local_rank: int) -> str:
        return f"{self.sync(generation)}{node}/{local_rank}"

    @property
    def readies(self) -> str:
        return self.job.root + "ready/"

    def ready_prefix(self, generation: int, step: int) -> str:
        return f"{self.readies}{generation}/{step}/"

    def ready(self, generation: int, step: int, rank: int) -> str:
        return f"{self.ready_prefix(generation, step)}{rank}"

    @property
    def decisions(self) -> str:
        return self.job.root + "decisions/"

    def decision(self, generation: int, step: int) -> str:
        return f"{self.decisions}{generation}/{step}"

    @property
    def recoveries(self) -> str:
        return self.job.root + "recoveries/"

    def recovery(self, generation: int, rank: int) -> str:
        return f"{self.recoveries}{generation}/{rank}"

    @property
    def done(self) -> str:
        return self.job.root + "done/"

    def worker_done(self, node: int, local_rank: int) -> str:
        return f"{self.done}{node}/{local_rank}"

    def injected(self, name: str) -> str:
        return f"{self.job.root}injected/{name}"

    def injection(self, request_id: str) -> str:
        return f"{self.job.injections}{request_id}"

    @property
    def injection_statuses(self) -> str:
        return self.job.root + "injection-status/"

    def injection_status(self, request_id: str) -> str:
        return f"{self.injection_statuses}{request_id}"


def read_progress(client: EtcdClient, rk: RunKeys) -> ProgressRecord | None:
    """The job's progress record (one key read); None before the first commit."""
    value, _ = client.get(rk.progress)
    return None if value is None else ProgressRecord.from_json(value)


def committed_steps(client: EtcdClient, rk: RunKeys) -> int:
    """How many steps the job has committed, from the progress record (one key read)."""
    record = read_progress(client, rk)
    return 0 if record is None else record.step + 1


def step_log_path(run_dir: str | Path, node: int, local_rank: int) -> Path:
    """The local log of per-step results that worker (node, local_rank) appends to while it is
    the first worker (stage 0, tensor-parallel rank 0) of a pipeline: one StepResult JSON a line."""
    return Path(run_dir) / "steps" / f"node{node}.worker{local_rank}.jsonl"


def read_step_logs(run_dir: str | Path) -> dict[int, StepResult]:
    """Every step result in the run's local step logs, by step (the newest generation's copy of a
    step wins; a torn last line of a killed writer is skipped)."""
    out: dict[int, StepResult] = {}
    for path in sorted((Path(run_dir) / "steps").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                r = StepResult.from_json(line)
            except RecordError:
                continue
            if r.step not in out or r.generation >= out[r.step].generation:
                out[r.step] = r
    return out


@dataclass(frozen=True, kw_only=True)
class ElasticConfig(JsonRecord):
    """What every process of an elastic run reads from etcd's `config` key."""

    spec: JobSpec
    """The training job; `spec.plan` is the plan of the first generation."""
    cluster: ClusterSpec
    """Planner inputs for the leader's re-planning (its `nodes` is the largest node count)."""
    injections: tuple[Injection, ...] = ()
    """Faults to inject, each carried out by the agent of its node (or the launcher for rejoin)."""
    checkpoint_every: int = 5
    """Committed steps between checkpoints (0: never)."""
    checkpoint_dir: str = ""
    """Directory of the checkpoints; empty means `<run_dir>/checkpoints`."""
    lease_ttl: int = 3
    """Seconds of silence after which etcd declares a node lost."""
    resume: ResumeSource | None = None
    """`elastic run --resume`: the earlier run's checkpoint that generation 1 restores (None: a
    fresh run, initialised from the seed)."""
    spares: int = 0
    """`elastic run --spares K`: hot spare nodes started beside the plan's nodes (node ids after
    the plan's); the leader keeps `cluster.nodes` nodes training and takes a spare in, in the
    same re-plan, for each node lost (elastic/planning/spares.py)."""
    stragglers: StragglerConfig = StragglerConfig()
    """`elastic run --straggler-policy/--straggler-threshold/--straggler-steps`: when a node counts
    as a straggler, and what is done about it (elastic/planning/stragglers.py)."""

    @property
    def checkpoint_path(self) -> str:
        return self.checkpoint_dir or f"{self.spec.run_dir}/checkpoints"


@dataclass(frozen=True, kw_only=True)
class GenerationRecord(JsonRecord):
    """One generation: its plan and why and from where training goes on under it."""

    plan: Plan
    """The plan of this generation."""
    resume_step: int
    """The next step to run (the first step of this generation)."""
    incarnations: dict[int, int]
    """Plan node -> the incarnation of that node taking part in this generation."""
    lost: list[int] = field(default_factory=list)
    """Nodes of the previous generation that are gone."""
    joined: list[int] = field(default_factory=list)
    """Nodes new in this generation."""
    drained: list[int] = field(default_factory=list)
    """Nodes of the previous generation removed on request (`elastic drain`): their workers
    serve their shards until this generation has committed a step, then leave with code 0."""
    restore_checkpoint: int | None = None
    """Checkpoint step every worker restores from (None: survivors keep their state)."""
    restore_dir: str | None = None
    """Directory of that checkpoint when it is not the job's own (a resumed run's generation 1:
    the earlier run's checkpoints, resharded to this plan's tensor-parallel degree)."""
    reason: str = "start"
    """Why this generation exists, in words."""
    detected_at: float | None = None
    """Wall time at which the leader saw the change (loss or join)."""
    published_at: float | None = None
    """Wall time at which the leader published this record."""
    synced_at: float | None = None
    """Wall time at which every live worker of the previous generation had reported (after a
    loss: once the pipelines that lost no node finished their microbatches)."""
    completed_vote: Vote | None = None
    """The vote of step `resume_step - 1` as a survivor saw it complete: a survivor whose own
    wait on that vote was cut short (it holds the step's reduced gradients, pending) commits the
    step with it before joining, so every survivor enters at `resume_step`."""
    replay: ReplayRecord | None = None
    """Step `resume_step` was interrupted: which of its microbatches survivors kept, so this
    generation computes only the others (None: the whole step is run)."""
    balanced_for: list[int] = field(default_factory=list)
    """The straggler nodes this plan's microbatch split allows for (`--straggler-policy
    rebalance`, elastic/planning/stragglers.py); empty: the planner's own split."""

    @property
    def replayed_fraction(self) -> float | None:
        """Share of the interrupted step computed again (None when no step was interrupted:
        a join or a drain at a step boundary, or the first generation)."""
        if self.replay is not None:
            return self.replay.replayed_fraction
        return 1.0 if self.lost and self.restore_checkpoint is None else None


@dataclass(frozen=True, kw_only=True)
class Vote:
    """The outcome of a step's vote (its world all-reduce), the same on every worker that saw it."""

    step: int
    """Index of the step voted on."""
    grad_norm: float
    """Global gradient norm before clipping (the clip factor follows from it)."""
    loss: float
    """Mean global-batch loss."""


@dataclass(frozen=True, kw_only=True)
class HaltRecord(JsonRecord):
    """The leader's request that generation g stop: `abort` (a member is lost: drop the in-flight
    step unless its vote completed) or at the next step boundary (a join or a drain)."""

    abort: bool
    """True: abandon the in-flight step now; False: finish it and stop after its commit."""
    reason: str
    """Why, in words."""
    at: float
    """Wall time the leader wrote it."""
    lost: list[int] = field(default_factory=list)
    """With `abort`: the lost nodes. A pipeline with none of them finishes its microbatches and
    keeps their gradients (partial replay); empty: every pipeline stops at once."""
    stop_step: int | None = None
    """A whole-job stop (elastic/records/stop.py): written over a boundary halt once every live
    worker of g reported S committed steps. No generation follows: each worker writes its
    checkpoint of step S, waits until it is on disk, reports itself done and exits 0."""


@dataclass(frozen=True, kw_only=True)
class SyncReport(JsonRecord):
    """What a worker of a halted generation holds, for the leader to pick the resume step."""

    committed: int | None
    """Steps the worker has committed (the index of its next step); None when it never joined
    the generation (its reconfiguration into it failed), so its step says nothing of it."""
    pending: int | None
    """A step whose vote this worker joined but did not see complete (its reduced gradients
    are kept until the next generation says commit or drop); None otherwise."""
    last_vote: Vote | None
    """The vote of its last committed step (None before the first commit of the job)."""
    node: int
    """Its plan node."""
    local_rank: int
    """Its index inside the node."""
    partial: PartialReport | None = None
    """Gradient sums it kept of step `committed` (its pipeline finished that step's
    microbatches before the step was abandoned); None if none."""


@dataclass(frozen=True, kw_only=True)
class ProgressRecord(JsonRecord):
    """The `progress` key: the last committed step and a short window of the steps before it.
    Readers (launcher, status, metrics, inject) read this one key, never a per-step history."""

    step: int
    """Index of the last committed step (0-based); `step + 1` steps are committed."""
    loss: float
    """Its mean global-batch loss."""
    grad_norm: float
    """Its global gradient norm before clipping."""
    lr: float
    """Its learning rate."""
    seconds: float
    """Its wall time on the writer, step start to commit."""
    generation: int
    """The generation that committed it."""
    committed_at: float
    """Wall time of its commit on the writer."""
    recent: list[list[float]] = field(default_factory=list)
    """[step, committed_at, seconds] of up to the last 8 steps committed, oldest first, this
    one last (steps the writer committed; a new writer after a re-plan starts a new window)."""
    earlier: list[list[float]] = field(default_factory=list)
    """[step, loss, grad_norm, lr, seconds, committed_at] of the steps of this record's
    generation committed since the previous record was written, oldest first, this one left out (the writer writes at most
    every `PROGRESS_MIN_INTERVAL_S`, so fast steps share a record); empty when none."""

    def result(self) -> StepResult:
        """The last step as a StepResult."""
        return StepResult(step=self.step, loss=self.loss, grad_norm=self.grad_norm, lr=self.lr,
                          seconds=self.seconds, generation=self.generation, committed_at=self.committed_at)

    def results(self) -> list[StepResult]:
        """Every step this record reports, oldest first: the `earlier` ones, then its own."""
        out = [StepResult(step=int(s), loss=loss, grad_norm=norm, lr=lr, seconds=sec, generation=self.generation,
                          committed_at=at) for s, loss, norm, lr, sec, at in self.earlier]
        return [*out, self.result()]


@dataclass(frozen=True, kw_only=True)
class WorkerInfo(JsonRecord):
    """A worker's registration under `workers/<node>/<local_rank>`."""

    pid: int
    """Its process id (the launcher counts restarts of survivors from these)."""
    transfer_address: str
    """host:port of its ShardServer."""
    incarnation: int
    """Incarnation of its node."""
    started: dict[str, float] = field(default_factory=dict)
    """Wall times of its start: spawned (its agent decided), forked (from a warm parent; absent
    for a fresh interpreter), process, main (imports done), registered (elastic/roles/start_phases.py)."""


@dataclass(frozen=True, kw_only=True)
class StepResult(JsonRecord):
    """What a committed step produced: the step engine's result of a commit (elastic/engine/step.py),
    which the progress writer publishes and each pipeline's first worker appends to its local log."""

    step: int
    """Index of the step (0-based)."""
    loss: float
    """Mean global-batch loss."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate applied (0 for a step skipped because its gradient is not finite)."""
    seconds: float
    """Wall time of the step on the committing worker, prepare to commit."""
    generation: int
    """Generation that committed it."""
    committed_at: float
    """Wall time of the commit on the committing worker."""


@dataclass(frozen=True, kw_only=True)
class ReconfigTimings:
    """Where the time of one worker's joining a generation went (what `Trainer.start` measured)."""

    transfer_s: float
    """Seconds spent getting the missing shards (over the generation's process group, then from
    their holders) and the kept gradient sums that move with a layer."""
    rebuild_s: float
    """Seconds spent building the process groups, the stage module, its optimizer state and its
    gradient buffers (the recovery breakdown's `rebuilding_s`, the slowest worker's)."""
    bytes_fetched: int
    """Bytes of fetched tensors (parameters and optimizer moments)."""
    bytes_collective: int = 0
    """The part of `bytes_fetched` that came over the generation's process group."""


@dataclass(frozen=True, kw_only=True)
class RecoveryTimings(JsonRecord):
    """One worker's reconfiguration into a generation, at `recoveries/<g>/<rank>`.

    Its JSON is one flat object (`reconfig`'s fields beside the others), the form that
    `elastic status`, `elastic events`, the metrics and the launcher have always read."""

    seen_at: float
    """Wall time the worker learned of the generation."""
    reconfig: ReconfigTimings = field(metadata=INLINE)
    """What joining the generation cost (transfer, rebuild, bytes)."""
    started_at: float
    """Wall time `Trainer.start` returned."""
    first_commit_at: float
    """Wall time of its first commit in the generation."""
