"""The etcd keys and records of an elastic run: what launcher, agents, leader and workers share.

Everything lives under the job's prefix `/elastic/<job>/` (see elastic/coordinator/keys.py for
members, leader, generation, plan/, committed, injections/, events/, token, store/):

    config                          ElasticConfig JSON: the job spec, planning inputs, injections
    workers/<node>/<local_rank>     {"pid", "transfer_address", "incarnation"} on the node's lease
    holdings/<node>/<local_rank>    [[layer, tp_rank], ...] the worker holds now, on the node's lease
    plan/<g>                        GenerationRecord JSON (published with Generations.publish)
    steps/<g>/<s>/ready/<rank>      a worker's prepare_step of step s in generation g succeeded
    steps/<g>/<s>/decision          "commit" | "abort", created once by the leader
    results/<s>                     StepResult of committed step s, by each pipeline's first worker
    recoveries/<g>/<rank>           a worker's timings of its reconfiguration into g
    done/<node>/<local_rank>        a worker finished every step and saved its outputs
    injected/<name>                 when an injection (request id <name>) was carried out (wall time)
    injections/<id>                 InjectionRequest JSON (see injection.py), from the CLI or the launcher
    injection-status/<id>           InjectionStatus JSON: running, done, refused or fenced

Node ids in etcd are `node<k>` for plan node k; a node's incarnation counts its (re)starts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from elastic.coordinator.keys import JobKeys
from elastic.coordinator.membership import read_members
from elastic.runtime.injection import Injection
from elastic.runtime.planning import ClusterSpec
from templates.plan import Plan

if TYPE_CHECKING:  # job.py imports torch (seconds): agents read the config before they need it
    from elastic.runtime.job import JobSpec

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


def live_nodes(client: Any, keys: JobKeys) -> dict[int, int]:
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
    def steps(self) -> str:
        return self.job.root + "steps/"

    def step(self, generation: int, step: int) -> str:
        return f"{self.steps}{generation}/{step}/"

    def ready(self, generation: int, step: int, rank: int) -> str:
        return f"{self.step(generation, step)}ready/{rank}"

    def decision(self, generation: int, step: int) -> str:
        return f"{self.step(generation, step)}decision"

    @property
    def results(self) -> str:
        return self.job.root + "results/"

    def result(self, step: int) -> str:
        return f"{self.results}{step:08d}"

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


def committed_steps(client: Any, rk: RunKeys) -> int:
    """How many steps the job has committed (one `results/<s>` key each)."""
    return sum(1 for _ in client.get_prefix(rk.results, keys_only=True))


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
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

    @property
    def checkpoint_path(self) -> str:
        return self.checkpoint_dir or f"{self.spec.run_dir}/checkpoints"

    def to_json(self) -> str:
        return json.dumps(
            {
                "spec": json.loads(self.spec.to_json()),
                "cluster": asdict(self.cluster),
                "injections": [i.to_dict() for i in self.injections],
                "checkpoint_every": self.checkpoint_every,
                "checkpoint_dir": self.checkpoint_dir,
                "lease_ttl": self.lease_ttl,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> ElasticConfig:
        from elastic.runtime.job import JobSpec

        data = json.loads(text)
        return cls(
            spec=JobSpec.from_json(json.dumps(data["spec"])),
            cluster=ClusterSpec(**data["cluster"]),
            injections=tuple(Injection.from_dict(i) for i in data["injections"]),
            checkpoint_every=int(data["checkpoint_every"]),
            checkpoint_dir=str(data["checkpoint_dir"]),
            lease_ttl=int(data["lease_ttl"]),
        )


@dataclass(frozen=True, kw_only=True)
class GenerationRecord:
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
    reason: str = "start"
    """Why this generation exists, in words."""
    detected_at: float | None = None
    """Wall time at which the leader saw the change (loss or join)."""
    published_at: float | None = None
    """Wall time at which the leader published this record."""

    def to_json(self) -> str:
        data: dict[str, Any] = asdict(self)
        data["plan"] = self.plan.to_dict()
        data["incarnations"] = {str(k): v for k, v in self.incarnations.items()}
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> GenerationRecord:
        data = json.loads(text)
        data["plan"] = Plan.from_dict(data["plan"])
        data["incarnations"] = {int(k): int(v) for k, v in data["incarnations"].items()}
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """A worker's registration under `workers/<node>/<local_rank>`."""

    pid: int
    """Its process id (the launcher counts restarts of survivors from these)."""
    transfer_address: str
    """host:port of its ShardServer."""
    incarnation: int
    """Incarnation of its node."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerInfo:
        return cls(**json.loads(text))


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What the first worker of each pipeline reports of a committed step."""

    step: int
    """Index of the step (0-based)."""
    loss: float
    """Mean global-batch loss."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate applied."""
    seconds: float
    """Wall time of the step on the reporting worker, prepare to commit."""
    generation: int
    """Generation that committed it."""
    committed_at: float
    """Wall time of the commit on the reporting worker."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> StepResult:
        return cls(**json.loads(text))


@dataclass(frozen=True, kw_only=True)
class RecoveryTimings:
    """One worker's reconfiguration into a generation."""

    seen_at: float
    """Wall time the worker learned of the generation."""
    transfer_s: float
    """Seconds fetching shards."""
    rebuild_s: float
    """Seconds building the generation's process groups."""
    bytes_fetched: int
    """Shard bytes it received."""
    started_at: float
    """Wall time `Trainer.start` returned."""
    first_commit_at: float
    """Wall time of its first commit in the generation."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> RecoveryTimings:
        return cls(**json.loads(text))
