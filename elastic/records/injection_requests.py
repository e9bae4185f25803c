"""Injection requests in etcd: every injection is an `InjectionRequest` under the job's
`injections/<id>` key (the launcher writes the `elastic run --inject` ones, injection.py, when the
job starts; `elastic inject`/`elastic drain` write the operator's). Who carries it out: the agent
of the node's targeted incarnation for kill, hang, slow and partition; the leader for drain; the
launcher for rejoin (it spawns the next incarnation). Whoever does writes an `InjectionStatus`
under `injection-status/<id>`. This file holds both records and their reads and writes.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Literal

from elastic.coordinator import schema
from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.jsonrecord import JsonRecord
from elastic.records.injection import Injection

RequestKind = Literal["kill", "hang", "slow", "partition", "drain", "rejoin"]
REQUEST_KINDS: tuple[RequestKind, ...] = ("kill", "hang", "slow", "partition", "drain", "rejoin")
AGENT_KINDS: tuple[RequestKind, ...] = ("kill", "hang", "slow", "partition")
"""Kinds carried out by the targeted node's agent (drain: the leader; rejoin: the launcher)."""
RequestWhen = Literal["now", "step", "reconfig"]
State = Literal["running", "done", "refused", "fenced"]


@dataclass(frozen=True, kw_only=True)
class InjectionRequest(JsonRecord):
    """One fault (or drain, or rejoin) asked of a running job, stored at `injections/<id>`."""

    id: str
    """Key-safe request id; contains `-node<N>-` (the recovery breakdown finds a node's faults by it)."""
    kind: RequestKind
    """What to do (module doc; the `--inject` kinds: injection.py)."""
    node: int
    """Plan node it targets."""
    incarnation: int | None
    """Incarnation of the node it targets (None for rejoin: the next one)."""
    when: RequestWhen = "now"
    """"now", "step" (while `step` is in flight) or "reconfig" (when the first reconfiguration begins)."""
    step: int | None = None
    """Step (1-based, as printed) for when="step"."""
    seconds: float | None = None
    """How long a slow or partition lasts."""
    steps: int | None = None
    """Slow, instead of `seconds`: it lasts while this many steps are in flight, from the one in
    flight when it begins."""
    factor: float | None = None
    """Slow: steps take about this many times longer (the workers run 1/factor of the time)."""
    at: float | None = None
    """With when="step": fire this fraction of the previous step's duration into `step`."""
    hold_cpu: bool = True
    """Slow: while the workers are stopped, a burner process per worker spins in their place
    (`Throttle`), so that simulated nodes sharing a host's cores do not run faster for it."""
    requested_at: float = 0.0
    """Wall time of the request."""
    by: str = "cli"
    """Who asked: "cli" (an operator), "config" (`elastic run --inject`), "sigterm" (a preempted
    node's agent asking for its own drain), or a test's name."""

    def __post_init__(self) -> None:
        if self.kind not in REQUEST_KINDS:
            raise ValueError(f"unknown request kind {self.kind!r}; use one of {', '.join(REQUEST_KINDS)}")
        if self.node < 0:
            raise ValueError(f"node must be >= 0, got {self.node}")
        if (self.when == "step") != (self.step is not None):
            raise ValueError("a step is given exactly when when='step'")
        if self.step is not None and self.step < 1:
            raise ValueError(f"step must be >= 1 (steps are numbered from 1), got {self.step}")
        if self.steps is not None and (self.kind != "slow" or self.steps < 1 or self.seconds is not None):
            raise ValueError(f"steps (>= 1, instead of seconds) apply to a slow request only, got {self.steps} "
                             f"for {self.kind} with seconds {self.seconds}")
        timed = self.kind == "partition" or (self.kind == "slow" and self.steps is None)
        if timed and (self.seconds is None or self.seconds <= 0):
            raise ValueError(f"{self.kind} needs seconds > 0, got {self.seconds}")
        if self.kind == "slow" and (self.factor is None or self.factor <= 1.0):
            raise ValueError(f"slow needs a factor > 1, got {self.factor}")
        if self.at is not None and (self.when != "step" or not 0.0 <= self.at <= 10.0):
            raise ValueError(f"at must be a fraction in [0, 10] of a step, with when='step' (got {self.at})")

    @classmethod
    def from_injection(cls, inj: Injection) -> InjectionRequest:
        """The request of one `--inject` value (targets incarnation 0; its id is `inj.name`)."""
        return cls(id=inj.name, kind=inj.kind, node=inj.node, incarnation=None if inj.kind == "rejoin" else 0,
                   when=inj.when, step=inj.step, at=inj.at, requested_at=time.time(), by="config")


def request_id(kind: str, node: int, step: int | None) -> str:
    """A fresh request id, e.g. `slow-node1-step5-3f2a9c` or `kill-node2-now-07be11`."""
    return f"{kind}-node{node}-{f'step{step}' if step is not None else 'now'}-{secrets.token_hex(3)}"


@dataclass(frozen=True, kw_only=True)
class InjectionStatus(JsonRecord):
    """What became of a request, at `injection-status/<id>` (rewritten as it progresses)."""

    state: State
    """running (a slow or partition under way), done, refused, or fenced (a healed partition found its node fenced)."""
    at: float
    """Wall time of this state."""
    step: int | None = None
    """Step (1-based) in flight when it was carried out, as far as the carrier knew."""
    generation: int | None = None
    """Drain: the generation without the node; fenced: the generation found after the heal."""
    detail: str = ""
    """Why it was refused, or what happened, in words."""


def submit_request(client: EtcdClient, root: str, request: InjectionRequest) -> None:
    """Write `request` under `<root>injections/<id>` (create-only: ValueError if the id exists)."""
    key = schema.key(root, "injections", request.id)
    txn = client.transactions
    ok, _ = client.transaction(compare=[txn.create(key) == 0], success=[txn.put(key, request.to_json())],
                               failure=[])
    if not ok:
        raise ValueError(f"injection request {request.id!r} already exists")


def read_requests(client: EtcdClient, root: str) -> list[InjectionRequest]:
    """Every request of the job, in id order."""
    return [InjectionRequest.from_json(v) for v, _ in client.get_prefix(schema.prefix(root, "injections"))]


def read_statuses(client: EtcdClient, root: str) -> dict[str, InjectionStatus]:
    """Request id -> its latest status, for the requests that have one."""
    prefix = schema.prefix(root, "injection-status")
    return {m.key.decode()[len(prefix) :]: InjectionStatus.from_json(v) for v, m in client.get_prefix(prefix)}


def read_status(client: EtcdClient, root: str, request_id: str) -> InjectionStatus | None:
    """The latest status of one request (one key read), None while it has none."""
    value, _ = client.get(schema.key(root, "injection-status", request_id))
    return None if value is None else InjectionStatus.from_json(value)


def write_status(client: EtcdClient, root: str, request_id: str, status: InjectionStatus) -> None:
    client.put(schema.key(root, "injection-status", request_id), status.to_json())
