"""The soak's seeded fault schedule and the controller that carries it out against a live job.

The schedule is a list of faults (kind, how many steps to let commit first, duration); the
controller fires them one after another through injection requests, the way an operator's
`elastic inject` does, on a node of the current generation (chosen by the fault's seeded
`pick`), waits for the job to lose the node, asks for the node's rejoin (a new incarnation;
a partitioned node is replaced while still cut off)
and waits for the job to take it back in before the next fault. So at most one node (f = 1)
is out at a time and the cluster always has what f+1 pipelines need. Slow faults fail nothing:
the controller waits for the slow-down to end.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic.coordinator.generations import Generations
from elastic.records.injection import InjectionRequest, read_statuses, request_id, submit_request
from elastic.records.protocol import GenerationRecord

from .runs import LiveJob

FAULT_KINDS = ("kill", "hang", "partition", "slow")
WEIGHTS = (0.35, 0.25, 0.2, 0.2)
WAIT_S = 120.0
"""Longest wait for one phase of one fault (loss seen, rejoin taken in, steps committed)."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One scheduled fault."""

    kind: str
    """kill, hang, partition or slow."""
    gap: int
    """Steps to let commit (after the previous fault's recovery) before this one fires."""
    pick: int
    """Seeded choice of the target among the current generation's nodes (index modulo their count)."""
    seconds: float | None = None
    """Duration of a partition (above the lease TTL) or of a slow-down."""
    factor: float | None = None
    """Slow-down factor of a slow fault."""


def soak_schedule(faults: int, *, seed: int, lease_ttl: int) -> list[Fault]:
    """`faults` faults drawn from `seed`; every kind appears at least once when faults >= 4."""
    if faults < 1:
        raise ValueError(f"a soak needs at least one fault, got {faults}")
    rng = random.Random(seed)
    kinds = list(FAULT_KINDS[: min(faults, len(FAULT_KINDS))])
    kinds += rng.choices(FAULT_KINDS, weights=WEIGHTS, k=faults - len(kinds))
    rng.shuffle(kinds)
    out = []
    for kind in kinds:
        seconds = factor = None
        if kind == "partition":
            seconds = round(lease_ttl + rng.uniform(1.0, 2.5), 1)
        elif kind == "slow":
            seconds, factor = round(rng.uniform(2.0, 4.0), 1), rng.choice((2.0, 3.0))
        out.append(Fault(kind=kind, gap=rng.randint(1, 4), pick=rng.randrange(1 << 16), seconds=seconds,
                         factor=factor))
    return out


@dataclass
class FaultLog:
    """What happened to one fault of the schedule."""

    index: int
    fault: Fault
    node: int
    incarnation: int
    request: str
    fired_after_step: int
    """Steps committed when the request was written."""
    status: str = ""
    lost_in: int | None = None
    """Generation that recorded the node's loss (None for slow)."""
    rejoin: str | None = None
    """Id of the rejoin request."""
    rejoined_in: int | None = None
    """Generation that took the node's next incarnation in."""
    seconds: float = 0.0
    """Wall time from the request to the node's return (or the end of the slow-down)."""
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        f = self.fault
        extra = f" {f.seconds:g}s" if f.seconds else ""
        extra += f" x{f.factor:g}" if f.factor else ""
        back = f", lost in g{self.lost_in}, back in g{self.rejoined_in}" if self.lost_in is not None else ""
        return (
            f"#{self.index:02d} {f.kind:<9}{extra:<10} node {self.node}.{self.incarnation} after step "
            f"{self.fired_after_step:4d}: {self.status}{back} ({self.seconds:.1f} s)"
        )


class SoakController:
    """Fires a schedule's faults into `job` one after another (module doc)."""

    def __init__(self, job: LiveJob, *, steps: int, say: Callable[[str], None] = print) -> None:
        self.job, self.steps, self.say = job, steps, say
        self.gens = Generations(job.client, job.keys)
        self.log: list[FaultLog] = []

    # ---- reading the job ---------------------------------------------------------------------

    def _record(self, g: int) -> GenerationRecord:
        gen = self.gens.get(g)
        assert gen is not None, f"generation {g} vanished"
        return GenerationRecord.from_json(gen.plan)

    def _wait(self, cond: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = cond()
            if value:
                return value
            if self.job.error is not None or not self.job._thread.is_alive():
                raise AssertionError(f"the run ended while waiting for {what}: {self.job.error!r}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.1)

    def _generation_where(self, after: int, test: Callable[[GenerationRecord], bool]) -> int | None:
        for g in range(after + 1, self.gens.current_number() + 1):
            if test(self._record(g)):
                return g
        return None

    def _final_status(self, rid: str, states: tuple[str, ...]) -> str | None:
        status = read_statuses(self.job.client, self.job.keys.root).get(rid)
        return status.state if status is not None and status.state in states else None

    # ---- carrying out the schedule -------------------------------------------------------------

    def run(self, schedule: list[Fault]) -> list[FaultLog]:
        for index, fault in enumerate(schedule):
            mark = self.job.committed() + fault.gap
            if mark >= self.steps - 2:
                raise AssertionError(
                    f"the run is at step {self.job.committed()} of {self.steps} with {len(schedule) - index} "
                    "faults left: raise ELASTIC_SOAK_STEPS"
                )
            self._wait(lambda m=mark: self.job.committed() >= m, f"step {mark} before fault #{index}")  # type: ignore[misc]
            self.log.append(self._fire(index, fault))
            self.say(self.log[-1].line())
        return self.log

    def _fire(self, index: int, fault: Fault) -> FaultLog:
        g = self.gens.current_number()
        record = self._record(g)
        nodes = sorted(record.plan.nodes)
        node = nodes[fault.pick % len(nodes)]
        incarnation = record.incarnations[node]
        rid = request_id(fault.kind, node, None)
        entry = FaultLog(index=index, fault=fault, node=node, incarnation=incarnation, request=rid,
                         fired_after_step=self.job.committed())
        t0 = time.monotonic()
        submit_request(self.job.client, self.job.keys.root, InjectionRequest(
            id=rid, kind=fault.kind, node=node, incarnation=incarnation, seconds=fault.seconds,  # type: ignore[arg-type]
            factor=fault.factor, requested_at=time.time(), by="soak"))
        if fault.kind == "slow":
            entry.status = self._wait(lambda: self._final_status(rid, ("done",)), f"{rid} to end")
            entry.seconds = time.monotonic() - t0
            return entry
        if fault.kind != "partition":
            entry.status = self._wait(lambda: self._final_status(rid, ("done",)), f"{rid} to be carried out")
        entry.lost_in = self._wait(
            lambda: self._generation_where(g, lambda r: node in r.lost),
            f"a generation that lost node {node} ({rid})",
        )
        entry.rejoin = request_id("rejoin", node, None)
        submit_request(self.job.client, self.job.keys.root, InjectionRequest(
            id=entry.rejoin, kind="rejoin", node=node, incarnation=None, requested_at=time.time(),
            by="soak"))
        entry.rejoined_in = self._wait(
            lambda: self._generation_where(g, lambda r: r.incarnations.get(node) == incarnation + 1),
            f"node {node} incarnation {incarnation + 1} to be taken back in ({entry.rejoin})",
        )
        # A partitioned node is replaced while still cut off: its agent, stopped by the rejoin,
        # still reports the partition (fenced) on its way out.
        entry.status = self._wait(
            lambda: self._final_status(rid, ("done", "fenced")), f"{rid} to be reported"
        )
        entry.seconds = time.monotonic() - t0
        return entry
