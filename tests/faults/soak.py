"""The soak's seeded fault schedule and the controller that carries it out against a live job.

The schedule is a list of faults (kind, how many steps to let commit first, duration); the
controller fires them one after another through injection requests, the way an operator's
`elastic inject` does, on a node of the current generation (chosen by the fault's seeded
`pick`), waits for the job to lose the node, asks for the node's rejoin (a new incarnation;
a partitioned node is replaced while still cut off)
and waits for the job to take it back in before the next fault. So at most one node (f = 1)
is out at a time and the cluster always has what f+1 pipelines need. Slow faults fail nothing:
the controller waits for the slow-down to end.

Two kinds go beyond that (issue 16). An `etcd` fault SIGKILLs one member of the job's etcd
cluster (`EtcdCluster`), lets steps commit for `seconds`, restarts it and waits until it is
healthy (one member down at a time): it must cost no node and no generation. A `fallback` fault
kills, while the same step is in flight, the first-stage node of every pipeline: every holder of
layer 0 is gone, more than f nodes at once, so the leader falls back to the last complete
checkpoint (the job needs `checkpoint_every`); both nodes then rejoin.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic.coordinator.etcd_cluster import EtcdCluster
from elastic.coordinator.generations import Generations
from elastic.records.generation import GenerationRecord
from elastic.records.injection_requests import InjectionRequest, read_statuses, request_id, submit_request

from .runs import LiveJob

FAULT_KINDS = ("kill", "hang", "partition", "slow", "etcd", "fallback")
WEIGHTS = (0.3, 0.2, 0.15, 0.15, 0.1, 0.1)
GUARANTEED_AT = 30
"""From this many faults on, the schedule holds at least 2 etcd member kills and 1 fallback."""
WAIT_S = 120.0
"""Longest wait for one phase of one fault (loss seen, rejoin taken in, steps committed)."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One scheduled fault."""

    kind: str
    """kill, hang, partition, slow, etcd (a member of the etcd cluster) or fallback (> f nodes)."""
    gap: int
    """Steps to let commit (after the previous fault's recovery) before this one fires."""
    pick: int
    """Seeded choice of the target among the current generation's nodes (index modulo their count)."""
    seconds: float | None = None
    """Duration of a partition (above the lease TTL), of a slow-down, or of an etcd member's
    absence."""
    factor: float | None = None
    """Slow-down factor of a slow fault."""


def soak_schedule(faults: int, *, seed: int, lease_ttl: int) -> list[Fault]:
    """`faults` faults drawn from `seed`; every kind appears at least once when faults >= 6, and
    at least 2 etcd member kills and 1 fallback when faults >= GUARANTEED_AT."""
    if faults < 1:
        raise ValueError(f"a soak needs at least one fault, got {faults}")
    rng = random.Random(seed)
    kinds = list(FAULT_KINDS[: min(faults, len(FAULT_KINDS))])
    if faults >= GUARANTEED_AT:
        kinds.append("etcd")
    kinds += rng.choices(FAULT_KINDS, weights=WEIGHTS, k=faults - len(kinds))
    rng.shuffle(kinds)
    out = []
    for kind in kinds:
        seconds = factor = None
        if kind == "partition":
            seconds = round(lease_ttl + rng.uniform(1.0, 2.5), 1)
        elif kind == "slow":
            seconds, factor = round(rng.uniform(2.0, 4.0), 1), rng.choice((2.0, 3.0))
        elif kind == "etcd":
            seconds = round(rng.uniform(2.0, 8.0), 1)  # past the 5 s retry budget at times: failover, not retries
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
    nodes: list[int] = field(default_factory=list)
    """Fallback: every node it killed (`node` is the first); `requests`, `lost_gens` and
    `rejoined_gens` are theirs (the losses may be seen in one generation or in two)."""
    requests: list[str] = field(default_factory=list)
    lost_gens: list[int] = field(default_factory=list)
    rejoined_gens: list[int] = field(default_factory=list)
    member: int | None = None
    """etcd: the index of the member killed."""

    def line(self) -> str:
        f = self.fault
        extra = f" {f.seconds:g}s" if f.seconds else ""
        extra += f" x{f.factor:g}" if f.factor else ""
        back = f", lost in g{self.lost_in}, back in g{self.rejoined_in}" if self.lost_in is not None else ""
        if self.nodes:
            back = f", lost in {self.lost_gens}, back in {self.rejoined_gens}"
        target = f"member {self.member}" if self.member is not None else f"node {self.node}.{self.incarnation}"
        if self.nodes:
            target = "nodes " + "+".join(str(n) for n in self.nodes)
        return (
            f"#{self.index:02d} {f.kind:<9}{extra:<10} {target} after step "
            f"{self.fired_after_step:4d}: {self.status}{back} ({self.seconds:.1f} s)"
        ) + (f" [{'; '.join(self.notes)}]" if self.notes else "")


class SoakController:
    """Fires a schedule's faults into `job` one after another (module doc)."""

    def __init__(self, job: LiveJob, *, steps: int, say: Callable[[str], None] = print,
                 cluster: EtcdCluster | None = None) -> None:
        """`cluster`: the job's etcd cluster, which `etcd` faults need."""
        self.job, self.steps, self.say, self.cluster = job, steps, say, cluster
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
        if fault.kind == "etcd":
            return self._kill_member(index, fault)
        if fault.kind == "fallback":
            return self._fall_back(index, fault)
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

    def _kill_member(self, index: int, fault: Fault) -> FaultLog:
        """SIGKILL one etcd member, let steps commit for `fault.seconds`, restart it (from this,
        the main thread: etcd's parent-death signal follows the starting thread)."""
        assert self.cluster is not None, "an etcd fault needs the job's EtcdCluster"
        assert fault.seconds is not None
        g = self.gens.current_number()
        member = fault.pick % len(self.cluster.members)
        entry = FaultLog(index=index, fault=fault, node=-1, incarnation=-1, request=f"etcd-member{member}",
                         fired_after_step=self.job.committed(), member=member)
        t0 = time.monotonic()
        leader = self.cluster.leader()
        self.cluster.kill(member)
        time.sleep(fault.seconds)
        during = self.job.committed()
        self.cluster.restart(member)
        entry.seconds = time.monotonic() - t0
        entry.notes.append(f"{'leader' if member == leader else 'follower'}, "
                           f"{during - entry.fired_after_step} steps committed while it was down")
        entry.status = "done" if self.gens.current_number() == g else f"generation {g} -> {self.gens.current_number()}"
        return entry

    def _fall_back(self, index: int, fault: Fault) -> FaultLog:
        """Kill the first-stage node of every pipeline while the same step is in flight (every
        holder of layer 0: a checkpoint fallback), then have them all rejoin."""
        g = self.gens.current_number()
        record = self._record(g)
        nodes = sorted({pipe.stages[0].node for pipe in record.plan.pipelines})
        step = self.job.committed() + 4  # 1-based, as printed: leave the agents time to read the requests
        entry = FaultLog(index=index, fault=fault, node=nodes[0], incarnation=record.incarnations[nodes[0]],
                         request=request_id("kill", nodes[0], step), fired_after_step=self.job.committed(),
                         nodes=nodes)
        t0 = time.monotonic()
        entry.requests.clear()
        for node in nodes:
            rid = entry.request if node == nodes[0] else request_id("kill", node, step)
            entry.requests.append(rid)
            submit_request(self.job.client, self.job.keys.root, InjectionRequest(
                id=rid, kind="kill", node=node, incarnation=record.incarnations[node], when="step", step=step,
                requested_at=time.time(), by="soak"))
        for rid in entry.requests:
            self._wait(lambda r=rid: self._final_status(r, ("done",)), f"{rid} to be carried out")  # type: ignore[misc]

        def lost_all() -> list[int] | None:
            gens = [h for h in range(g + 1, self.gens.current_number() + 1) if set(self._record(h).lost) & set(nodes)]
            lost = {n for h in gens for n in self._record(h).lost}
            return gens if set(nodes) <= lost else None

        entry.lost_gens = self._wait(lost_all, f"generations that lost nodes {nodes}")
        entry.lost_in = entry.lost_gens[0]
        after = self.gens.current_number()
        for node in nodes:
            submit_request(self.job.client, self.job.keys.root, InjectionRequest(
                id=request_id("rejoin", node, None), kind="rejoin", node=node, incarnation=None,
                requested_at=time.time(), by="soak"))

        def back_all() -> list[int] | None:
            gens = [h for h in range(after + 1, self.gens.current_number() + 1)
                    if any(self._record(h).incarnations.get(n) == record.incarnations[n] + 1 for n in nodes)]
            back = {n for h in gens for n in nodes if self._record(h).incarnations.get(n) == record.incarnations[n] + 1}
            return gens if back == set(nodes) else None

        entry.rejoined_gens = self._wait(back_all, f"nodes {nodes} to be taken back in")
        entry.rejoined_in = entry.rejoined_gens[-1]
        entry.status = "done"
        entry.seconds = time.monotonic() - t0
        return entry


def check_exactly_once(logs: dict[str, list[Any]], fallbacks: dict[int, int], steps: int) -> None:
    """Every step committed, by one generation, in order; except that the steps a checkpoint
    fallback rolled back (`fallbacks`: its generation -> the checkpoint's step count) are committed
    once more, by that generation or a later one. `logs`: each pipeline-first worker's step log."""
    commits: dict[int, list[int]] = {}
    for name, results in logs.items():
        last: Any = None
        for r in results:
            if last is not None and r.step <= last.step:
                rewound = [c for g, c in fallbacks.items() if last.generation < g <= r.generation]
                assert rewound and r.step >= min(rewound), f"{name}: step {r.step} after {last.step} with no fallback"
            last = r
            commits.setdefault(r.step, []).append(r.generation)
    assert sorted(commits) == list(range(steps)), f"steps never committed: {set(range(steps)) - set(commits)}"
    firsts = [min(commits[s]) for s in range(steps)]
    assert firsts == sorted(firsts), "a step committed by an older generation than the one before it"
    for step, gens in commits.items():
        distinct = sorted(set(gens))
        for a, b in zip(distinct, distinct[1:], strict=False):
            assert any(a < g <= b and c <= step for g, c in fallbacks.items()), (
                f"step {step} committed by generations {distinct} with no fallback between them")
