"""The etcd key layout of one job, in one place.

Everything a job stores lives under `/elastic/<job>/`:

    members/<node_id>          NodeIdentity JSON, attached to the node's lease
    failed/<node_id>/<inc>     a failure report (who saw it, when, why); no lease
    suspects/<node_id>/<inc>/<reporter>   a suspicion raised by a worker's collective error
    leader                     the elected leader's id, attached to its lease
    generation                 the latest committed generation number (decimal)
    plan/<generation:012d>     the plan JSON of that generation, written once
    injections/<id>            fault-injection requests from the operator CLI
    events/<time_ns>-<who>     an append-only log of what happened
    token                      hash of the job token (see access.py)
    rdzv/...                   torchrun rendezvous state (see rendezvous.py)
    store/<prefix>/<key>       c10d Store keys (see store.py), one prefix per generation

The records of the runtime (progress, halts, holdings, workers, recoveries, ...) live under the
run prefix that `elastic/records/protocol.py` (`RunKeys`) lays out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
        return f"/elastic/{self.job}/"

    @property
    def members(self) -> str:
        return self.root + "members/"

    def member(self, node_id: str) -> str:
        return self.members + check_name("node id", node_id)

    @property
    def failed(self) -> str:
        return self.root + "failed/"

    def failure(self, node_id: str, incarnation: int) -> str:
        return f"{self.failed}{check_name('node id', node_id)}/{incarnation}"

    def suspects(self, node_id: str, incarnation: int) -> str:
        return f"{self.root}suspects/{check_name('node id', node_id)}/{incarnation}/"

    @property
    def leader(self) -> str:
        return self.root + "leader"

    @property
    def generation(self) -> str:
        return self.root + "generation"

    @property
    def plans(self) -> str:
        return self.root + "plan/"

    def plan(self, generation: int) -> str:
        if generation < 0:
            raise ValueError(f"generation must be >= 0, got {generation}")
        return f"{self.plans}{generation:012d}"

    @property
    def injections(self) -> str:
        return self.root + "injections/"

    @property
    def events(self) -> str:
        return self.root + "events/"

    @property
    def token(self) -> str:
        return self.root + "token"

    @property
    def rdzv(self) -> str:
        return self.root + "rdzv/"

    def store(self, prefix: str) -> str:
        return f"{self.root}store/{prefix.strip('/')}/"
