"""The key builders of one job: `JobKeys` (the coordinator's keys and any family by name) and
`RunKeys` (the elastic runtime's records), both built from the etcd schema's table.

Every key of a job, with its pattern, lease, writer and readers, is listed once, in
elastic/coordinator/schema.py; the methods here only name the common ones. A family without a
method of its own is built with `JobKeys.key(family, *fields)` / `JobKeys.prefix(family, *fields)`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .schema import ROOT, key, prefix

_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def check_name(what: str, name: str) -> str:
    """`name` if it is safe as one key segment, else ValueError naming `what`."""
    if not _NAME_RE.match(name):
        raise ValueError(f"{what} {name!r} must be 1-128 characters of [A-Za-z0-9_.:-]")
    return name


@dataclass(frozen=True)
class JobKeys:
    """Key names of one job; every method returns a full key (str) or a prefix ending in '/'."""

    job: str

    def __post_init__(self) -> None:
        if not _JOB_RE.match(self.job):
            raise ValueError(f"job id {self.job!r} must be 1-128 characters of [A-Za-z0-9_.-]")

    @property
    def root(self) -> str:
        return f"{ROOT}{self.job}/"

    def key(self, family: str, *fields: object) -> str:
        """The key of schema family `family`, every field given in pattern order."""
        return key(self.root, family, *fields)

    def prefix(self, family: str, *fields: object) -> str:
        """The prefix of schema family `family` whose first fields are `fields`."""
        return prefix(self.root, family, *fields)

    @property
    def members(self) -> str:
        return self.prefix("members")

    def member(self, node_id: str) -> str:
        return self.key("members", check_name("node id", node_id))

    @property
    def failed(self) -> str:
        return self.prefix("failed")

    def failure(self, node_id: str, incarnation: int) -> str:
        return self.key("failed", check_name("node id", node_id), incarnation)

    def suspect(self, node_id: str, incarnation: int, reporter: str) -> str:
        return self.key("suspects", check_name("node id", node_id), incarnation, check_name("reporter", reporter))

    def probe(self, node_id: str, incarnation: int) -> str:
        return self.key("probes", check_name("node id", node_id), incarnation)

    @property
    def suspicion(self) -> str:
        return self.key("suspicion")

    @property
    def leader(self) -> str:
        return self.key("leader")

    @property
    def generation(self) -> str:
        return self.key("generation")

    @property
    def plans(self) -> str:
        return self.prefix("plan")

    def plan(self, generation: int) -> str:
        if generation < 0:
            raise ValueError(f"generation must be >= 0, got {generation}")
        return self.key("plan", generation)

    @property
    def injections(self) -> str:
        return self.prefix("injections")

    @property
    def events(self) -> str:
        return self.prefix("events")

    @property
    def token(self) -> str:
        return self.key("token")

    @property
    def fatal(self) -> str:
        """Why the job cannot go on: the leader's reason, or `worker_gave_up`'s."""
        return self.key("fatal")

    def store(self, scope: str) -> str:
        return self.prefix("store", scope.strip("/"))


@dataclass(frozen=True)
class RunKeys:
    """Keys of the elastic runtime's records, beside the coordinator's JobKeys of the same job."""

    job: JobKeys

    def prefix(self, family: str, *fields: object) -> str:
        """The prefix of schema family `family` whose first fields are `fields` (e.g.
        `prefix("ready", g)`: every ready mark of generation g)."""
        return self.job.prefix(family, *fields)

    @property
    def config(self) -> str:
        return self.job.key("config")

    @property
    def workers(self) -> str:
        return self.prefix("workers")

    def worker(self, node: int, local_rank: int) -> str:
        return self.job.key("workers", node, local_rank)

    def node_workers(self, node: int) -> str:
        return self.prefix("workers", node)

    @property
    def holdings(self) -> str:
        return self.prefix("holdings")

    def worker_holdings(self, node: int, local_rank: int) -> str:
        return self.job.key("holdings", node, local_rank)

    @property
    def progress(self) -> str:
        return self.job.key("progress")

    @property
    def halts(self) -> str:
        return self.prefix("halt")

    def halt(self, generation: int) -> str:
        return self.job.key("halt", generation)

    def sync(self, generation: int) -> str:
        return self.prefix("sync", generation)

    def sync_report(self, generation: int, node: int, local_rank: int) -> str:
        return self.job.key("sync", generation, node, local_rank)

    def node_sync(self, generation: int, node: int) -> str:
        """A node's workers' sync reports of `generation`, folded (elastic/records/node_sync.py)."""
        return self.job.key("node-sync", generation, node)

    def ready(self, generation: int, step: int, rank: int) -> str:
        return self.job.key("ready", generation, step, rank)

    def decision(self, generation: int, step: int) -> str:
        return self.job.key("decisions", generation, step)

    @property
    def recoveries(self) -> str:
        return self.prefix("recoveries")

    def recovery(self, generation: int, node: int) -> str:
        return self.job.key("recoveries", generation, node)

    @property
    def done(self) -> str:
        return self.prefix("done")

    def worker_done(self, node: int, local_rank: int) -> str:
        return self.job.key("done", node, local_rank)

    def injected(self, name: str) -> str:
        return self.job.key("injected", name)


WORKER_GAVE_UP = "a worker gave up"


def worker_gave_up(who: str, generation: int, exc: BaseException) -> str:
    """The `fatal` value a worker writes (the leader writes its reason alone)."""
    return f"{WORKER_GAVE_UP} (worker {who}, generation {generation}): {exc}"


def why_failed(fatal: str) -> str:
    """The `fatal` value as people read it: who gave up, then why."""
    return fatal if fatal.startswith(WORKER_GAVE_UP) else f"the leader gave up: {fatal}"
