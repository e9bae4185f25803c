"""The node side of bench/control_plane_scale.py: simulated nodes, and the shard that hosts some.

A shard is one OS process (started with multiprocessing's "spawn" context: gRPC's threads do
not survive a fork) that hosts a subset of the simulated nodes exactly as the one-process bench
did: their etcd clients, `SimNode`s (member lease, election, Leader, InjectionTrigger, the watch
on `injections/`), their `SimWorker`s (the feeds and the writer of a real ElasticWorker) and one
driver thread a node. The parent (control_plane_scale.run_one) talks to each shard over one
`multiprocessing.Pipe`: a request `(seq, command, args)` is answered `(seq, "ok" | "error",
value)`; a `tick` (step s, the parent's wall time when its vote completed) is posted without an
answer, in order with everything else on that pipe. See `Shard` for the commands.

A shard exits when told (`teardown` "exit" after the orderly stages, or "abort"), when its pipe
closes (the parent is gone, SIGKILL included: no orphans), or on SIGTERM; it ignores SIGINT, so
that a Ctrl-C is the parent's to handle: its `finally` ends every shard (in order after a normal
run or an error, at once when interrupted) and then joins (or kills) it by its PID.
`procs=0` in the parent runs the one shard as a thread of the parent instead (the old
one-process layout, for comparison), with the same protocol.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from elastic.coordinator import (
    EtcdConfig,
    JobKeys,
    LeaderElection,
    Membership,
    MembershipConfig,
    NodeIdentity,
    connect,
)
from elastic.coordinator.generations import Generations
from elastic.coordinator.keys import RunKeys
from elastic.coordinator.watch import PrefixWatch, WatchEvent
from elastic.parallel.layout import ParallelLayout
from elastic.records.config import ElasticConfig
from elastic.records.generation import Vote
from elastic.records.node_workers import registration
from elastic.records.progress import StepResult
from elastic.records.recovery_timings import ReconfigTimings, RecoveryTimings
from elastic.records.sync import SyncReport
from elastic.records.workers import WorkerInfo, node_id
from elastic.roles.injection_trigger import InjectionTrigger
from elastic.roles.leader import Leader
from elastic.roles.node_feed import subscriber
from elastic.roles.node_relay import NodeRelay, RelayClient, put_all
from elastic.roles.worker_feeds import DecisionFeed, GenerationFeed, HaltFeed, ProgressWriter, write_sync

log = logging.getLogger("control_plane_shard")

THREAD_STACK = 256 * 1024
"""Stack of each thread started by the bench (8 MiB by default; a shard runs ~1k threads)."""


# ---- small helpers (both sides) ------------------------------------------------------------


def process_cpu() -> float:
    """CPU seconds (user + system) of this process so far."""
    t = os.times()
    return t.user + t.system


def set_grpc_poll(seconds: float) -> None:
    """How often a thread blocked on a gRPC stream wakes up while idle (see the module doc of
    control_plane_scale)."""
    import grpc._common

    grpc._common.MAXIMUM_WAIT_TIMEOUT = seconds


def in_parallel(fns: list[Callable[[], Any]], threads: int = 16) -> list[Any]:
    """Run `fns` on a small pool (they block on etcd round trips), results in order."""
    if not fns:
        return []
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(lambda f: f(), fns))


SIM_RETRY_S = 30.0
"""How long a simulated node's etcd client retries a call that times out (see `Shard.cmd_setup`)."""


# ---- the simulated pieces ------------------------------------------------------------------


class StepClock:
    """The step's vote: tick s means the world all-reduce of step s completed, at `at(s)` (the
    parent's wall time when it sent the tick; one host, one clock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.times: list[float] = []

    def record(self, step: int, at: float) -> None:
        with self.lock:
            if step != len(self.times):
                raise ValueError(f"tick {step} after {len(self.times)} ticks")
            self.times.append(at)

    def last(self) -> int:
        with self.lock:
            return len(self.times) - 1

    def at(self, step: int) -> float:
        with self.lock:
            return self.times[step]


class AbortFlag:
    """The generation's abort signal as the feeds see it (control.Abortable); wakes the driver."""

    def __init__(self, wake: threading.Event) -> None:
        self._wake = wake
        self.at: float | None = None
        self.reason = ""

    def set(self, reason: str, *, local: bool = False) -> None:
        """Like AbortSignal.set; `local` (a worker's own abort) makes no difference to a simulated worker."""
        if self.at is None:
            self.at, self.reason = time.time(), reason
        self._wake.set()

    def is_set(self) -> bool:
        return self.at is not None


class TimedTrigger(InjectionTrigger):
    """The agent's InjectionTrigger, noting when each committed step reached it."""

    def __init__(self, client: Any, keys: JobKeys) -> None:
        self.seen: dict[int, float] = {}
        self.events = 0
        self._upto = -1
        super().__init__(client, keys)
        self.pin()  # the worst case: every agent's injection waits for a step (the runtime's watch is lazy)

    def _on_progress(self, events: list[WatchEvent]) -> None:
        super()._on_progress(events)
        now = time.time()
        self.events += len(events)
        with self._cond:  # not in_flight(): _hold calls this with the watch lock held
            committed = self._committed
        for s in range(self._upto + 1, committed + 1):
            self.seen[s] = now
        self._upto = max(self._upto, committed)


@dataclass
class Timings:
    """Per-call samples of the failure-free steps (seconds)."""

    requested: list[float] = field(default_factory=list)
    latest: list[float] = field(default_factory=list)
    publish: list[float] = field(default_factory=list)
    per_step: list[float] = field(default_factory=list)
    lag: list[float] = field(default_factory=list)
    publish_at: dict[int, float] = field(default_factory=dict)


class SimWorker:
    """One worker's control-plane side: registration, the feeds, the writer, its reports."""

    def __init__(self, node: SimNode, local_rank: int) -> None:
        self.node, self.local_rank = node, local_rank
        client, rk = node.client, node.rk
        info = worker_info(node.node, local_rank, node.incarnation)
        put_all(client, node.relay, [], [registration(rk, node.node, local_rank, info, node.lease)])  # as ElasticWorker
        # As an ElasticWorker: its feeds through the node's agent (one watch a prefix a node), or,
        # with --no-relay, each a watch of the worker's own.
        follow = subscriber(client, node.relay.name if node.relay is not None else None)
        self.generations = GenerationFeed(Generations(client, node.keys), subscribe=follow)
        self.halts = HaltFeed(client, rk, subscribe=follow)
        self.decisions = DecisionFeed(client, rk, subscribe=follow)
        self.progress = ProgressWriter(client, rk)
        self.abort = AbortFlag(node.wake)
        self.relay = RelayClient(node.relay.name) if node.relay is not None else None
        self.generation = 0
        self.rank = -1
        self.held: list[tuple[int, int]] = []
        self.committed = 0
        self.last_vote: Vote | None = None
        self.synced_at: float | None = None

    def enter(self, generation: int) -> None:
        """What `_reconfigure` and the first commit of `_train` do with etcd: enter the feeds;
        then the recovery record (its timings are placeholders: nothing is transferred here)."""
        record, seen_at = self.generations.get(generation)
        layout = ParallelLayout(plan=record.plan, generation=generation, node=self.node.node,
                                local_rank=self.local_rank)
        self.generation, self.rank = generation, layout.rank
        self.held = [(layer, self.local_rank) for layer in range(*layout.layers)]
        self.generations.enter(generation, self.abort)
        self.halts.enter(generation, self.abort)
        now = time.time()
        rec = RecoveryTimings(ranks=[layout.rank], seen_at=seen_at, started_at=now, first_commit_at=now,
                              reconfig=ReconfigTimings(transfer_s=0.0, rebuild_s=0.0, bytes_fetched=0))
        put_all(self.node.client, self.relay, [], [(self.node.rk.recovery(generation, self.node.node), rec)])

    def step(self, s: int, t: Timings) -> None:
        """Step s's vote completed: commit it, then the checks `_train` makes before step s+1."""
        t0 = time.perf_counter()
        self.committed, self.last_vote = s + 1, Vote(step=s, grad_norm=1.0, loss=2.0)
        if self.rank == 0:
            now = time.time()
            result = StepResult(step=s, loss=2.0, grad_norm=1.0, lr=1e-4, seconds=0.02,
                                generation=self.generation, committed_at=now)
            p0 = time.perf_counter()
            self.progress.publish(result)
            t.publish.append(time.perf_counter() - p0)
            t.publish_at[s] = now
        r0 = time.perf_counter()
        halt = self.halts.requested(self.generation)
        r1 = time.perf_counter()
        newer = self.generations.latest() > self.generation
        r2 = time.perf_counter()
        t.requested.append(r1 - r0)
        t.latest.append(r2 - r1)
        t.per_step.append(r2 - t0)
        if newer or (halt is not None and halt.abort):
            self.abort.set("seen at a step boundary")

    def report_halted(self) -> None:
        """`_report_halted`: the worker's sync report of its generation."""
        report = SyncReport(committed=self.committed, pending=None, last_vote=self.last_vote,
                            node=self.node.node, local_rank=self.local_rank)
        write_sync(self.node.client, self.node.rk, self.generation, report, holdings=self.held,
                   lease=self.node.lease, relay=self.relay)
        self.synced_at = time.time()

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
        self.progress.close(timeout=2.0)
        self.generations.close()
        self.halts.close()
        self.decisions.close()


def stop_agent(trigger: InjectionTrigger | None, leader: Leader | None, election: LeaderElection | None) -> None:
    """What a simulated agent stops, in the agent's order: its trigger, its Leader, then its
    candidacy (resigning last, so that no other leader takes over while this one still runs)."""
    if trigger is not None:
        trigger.close()
    if leader is not None:
        leader.stop()
    if election is not None:
        election.resign()


def join_member(client: Any, keys: JobKeys, config: ElasticConfig, node: int, gpus: int) -> tuple[Membership, int]:
    """Node `node`'s member, joined as `Agent.run` joins it (incarnation 0), and its lease."""
    membership = Membership(client, keys, NodeIdentity(node_id=node_id(node), incarnation=0,
                            address=f"127.0.0.1:{10000 + node}", devices=gpus),
                            config=MembershipConfig(ttl=config.lease_ttl))
    membership.join()
    assert membership.lease_id is not None
    return membership, membership.lease_id


def worker_info(node: int, local_rank: int, incarnation: int = 0) -> WorkerInfo:
    """What a simulated worker registers in `workers/<node>/all`: a real worker's fields, with the
    five start stamps of `worker_stamps` (wall times, as spread as a warm start's)."""
    now = time.time()
    stamps = {"spawned": now - 0.9, "forked": now - 0.85 + local_rank * 0.0013, "main": now - 0.4 + local_rank * 0.011,
              "registered": now + local_rank * 0.017}
    stamps["process"] = stamps["forked"]
    return WorkerInfo(pid=os.getpid(), transfer_address=f"127.0.0.1:{20000 + node * 64 + local_rank}",
                      incarnation=incarnation, started=stamps)


class SimNode:
    """One node: its agent's control plane (member, election, leader, trigger) and G workers."""

    def __init__(self, client: Any, keys: JobKeys, config: ElasticConfig, node: int, gpus: int, relay: bool) -> None:
        self.client, self.keys, self.rk, self.config = client, keys, RunKeys(keys), config
        self.relay = NodeRelay(client, name=f"bench-relay-{keys.job}-{node}", workers=gpus) if relay else None
        """The agent's relay (elastic/roles/node_relay.py): the node's workers' reports as one transaction."""
        self.node, self.gpus, self.incarnation = node, gpus, 0
        self.who = node_id(node)
        self.membership, self.lease = join_member(client, keys, config, node, gpus)
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.workers: list[SimWorker] = []
        self.election: LeaderElection | None = None
        self.leader: Leader | None = None
        self.trigger: TimedTrigger | None = None
        self.requests: PrefixWatch | None = None
        self.halted = False
        self.done_step = -1
        self._thread: threading.Thread | None = None

    def start_workers(self) -> None:
        self.workers = [SimWorker(self, r) for r in range(self.gpus)]

    def start_agent(self, with_leader: bool = True) -> None:
        """What `Agent.run` starts besides the worker processes (metrics and monitor aside);
        `with_leader=False` leaves out the standby Leader (not what the real agent does)."""
        self.trigger = TimedTrigger(self.client, self.keys)
        self.election = LeaderElection(self.client, self.keys, self.who, ttl=self.config.lease_ttl).start()
        if with_leader:
            self.leader = Leader(self.client, self.keys, self.config, self.election, who=self.who).start()
        self.requests = PrefixWatch(self.client, self.keys.injections, lambda evs: None, start_revision=1)

    def run(self, clock: StepClock, timings: Timings) -> None:
        self._thread = threading.Thread(target=self._drive, args=(clock, timings), name=f"drive-{self.who}",
                                        daemon=True)
        self._thread.start()

    def _drive(self, clock: StepClock, t: Timings) -> None:
        done = -1
        while not self.stop.is_set():
            self.wake.wait(0.5)
            self.wake.clear()
            if self.stop.is_set():
                return
            if not self.halted and any(w.abort.is_set() for w in self.workers):
                self.halted = True  # the in-flight step is abandoned; every worker reports, side by side
                in_parallel([w.report_halted for w in self.workers], threads=len(self.workers))
                continue
            if self.halted:
                continue
            last = clock.last()
            while done < last:
                done += 1
                t.lag.append(time.time() - clock.at(done))
                for w in self.workers:
                    w.step(done, t)
            self.done_step = done

    def kill(self) -> None:
        """Every process of the node is gone (its member stays until reported)."""
        self.stop_driver()
        in_parallel([w.close for w in self.workers], threads=8)
        self.close_agent()

    def stop_driver(self) -> None:
        self.stop.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def close_agent(self) -> None:
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        if self.requests is not None:
            self.requests.cancel()
        stop_agent(self.trigger, self.leader, self.election)
        self.requests = self.trigger = self.leader = self.election = None


# ---- the shard: some nodes, served over a pipe -----------------------------------------------


@dataclass(frozen=True)
class ShardSpec:
    """What a shard needs to host its nodes (picklable: it crosses the spawn)."""

    index: int
    endpoint: str
    job: str
    config_json: str
    nodes: tuple[int, ...]
    gpus: int
    grpc_poll_s: float
    switch_interval_s: float = 0.05
    """CPython's forced GIL switch period in the shard (`sys.setswitchinterval`; see the bench's doc)."""
    relay: bool = True
    """Whether each node's workers report through their agent's relay (`--no-relay`: each puts directly)."""
    log_level: int = logging.ERROR
    light: bool = False
    """A `LightShard` (bench/control_plane_light_shard.py) instead of a `Shard`."""
    nodes_per_client: int = 1
    """Light shards: nodes sharing one etcd client (1: a client a node, as real agents)."""


TEARDOWN_STAGES = ("stop_drivers", "close_workers", "close_agents", "leave", "exit")
"""In this order on every shard (each stage on all shards before the next): no node leaves while
a leader elsewhere still runs, as in the one-process bench."""


class NodeHost:
    """What every kind of shard does with the nodes it hosts (`Shard`'s `SimNode`s, and
    bench/control_plane_light_shard.py's `LightNode`s): each node has a `membership`, an
    `election` and a `leader` once its agent started, and `kill()`."""

    nodes: dict[int, Any]

    def __init__(self, spec: ShardSpec) -> None:
        self.spec = spec
        self.keys = JobKeys(spec.job)
        self.config = ElasticConfig.from_json(spec.config_json)
        self.clients: list[Any] = []
        self.nodes = {}
        self.killed: set[int] = set()
        self.exiting = False

    def _live(self) -> list[Any]:
        """The nodes not killed."""
        return [n for n in self.nodes.values() if n.node not in self.killed]

    def _agentless(self, which: list[int] | None) -> list[Any]:
        """The nodes of `which` (None: every node whose agent has not started yet)."""
        return [n for n in self.nodes.values() if (n.node in which if which is not None else n.election is None)]

    def _leases_lost(self) -> list[int]:
        """Live nodes whose member lease was lost."""
        return [n.node for n in self._live() if n.membership.lease is not None and n.membership.lease.lost.is_set()]

    def cmd_wait_leader(self, node: int, timeout: float) -> bool:
        election = self.nodes[node].election
        return election is not None and bool(election.wait_leader(timeout))

    def cmd_leader_rounds(self, node: int) -> int:
        leader = self.nodes[node].leader
        return -1 if leader is None else int(leader.rounds)

    def cmd_usage(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "cpu": process_cpu(), "threads": threading.active_count()}

    def cmd_kill(self, node: int) -> None:
        self.killed.add(node)
        self.nodes[node].kill()

    def cmd_report_failure(self, node: int) -> tuple[float, bool]:
        """The worker monitor's path: the node's member reported failed; (when, whether it was)."""
        at = time.time()
        return at, self.nodes[node].membership.report_failure(reason="bench: simulated node failure")

    def _end(self, stage: str, nodes: list[Any]) -> None:
        """The teardown stages every shard has: `nodes` leave, or the process ends (at once with
        "abort", after closing its clients with "exit")."""
        if stage == "leave":
            in_parallel([n.membership.leave for n in nodes], threads=32)
        elif stage == "abort":
            self.exiting = True  # the process ends at once (interrupted run: no orderly closing)
        elif stage == "exit":
            for c in self.clients:
                with contextlib.suppress(Exception):
                    c.close()
            self.exiting = True
        else:
            raise ValueError(f"unknown teardown stage {stage!r}")


class Shard(NodeHost):
    """The nodes of one shard and the commands the parent sends it (`cmd_<name>`)."""

    nodes: dict[int, SimNode]

    def __init__(self, spec: ShardSpec) -> None:
        super().__init__(spec)
        self.clock = StepClock()
        self.timings = Timings()

    # -- setup ----------------------------------------------------------------------------------

    def cmd_setup(self) -> dict[str, Any]:
        """One etcd client a node (its agent and its workers share it) and the nodes' members."""
        t0 = time.perf_counter()
        # A longer retry budget than the runtime's 5 s: at W = 1024 the set-up (thousands of
        # watches opening, 128 elections) starves a shard's gRPC threads for several seconds, and
        # only what follows the set-up is measured.
        self.clients = [connect(EtcdConfig(endpoint=self.spec.endpoint, retry_s=SIM_RETRY_S)) for _ in self.spec.nodes]
        made = in_parallel([
            functools.partial(SimNode, c, self.keys, self.config, n, self.spec.gpus, self.spec.relay)
            for c, n in zip(self.clients, self.spec.nodes, strict=True)
        ])
        self.nodes = {n.node: n for n in made}
        return {"pid": os.getpid(), "seconds": round(time.perf_counter() - t0, 3)}

    def cmd_start_workers(self) -> None:
        in_parallel([n.start_workers for n in self.nodes.values()])

    def cmd_enter(self, generation: int) -> None:
        """Every live worker enters `generation` (its feeds, and the recovery record it writes).
        A node's workers side by side, as processes of their own: the relay writes a node's
        records once all of its workers have sent theirs."""
        live = [n for n in self.nodes.values() if n.node not in self.killed]
        in_parallel([
            functools.partial(in_parallel, [functools.partial(w.enter, generation) for w in n.workers],
                              threads=len(n.workers))
            for n in live
        ])

    def cmd_start_agents(self, which: list[int] | None, with_leader: bool) -> None:
        """Start the agents of `which` nodes (None: every node without one yet)."""
        in_parallel([functools.partial(n.start_agent, with_leader) for n in self._agentless(which)])

    # -- failure-free steps ---------------------------------------------------------------------

    def cmd_run(self) -> None:
        for n in self.nodes.values():
            n.run(self.clock, self.timings)

    def cmd_tick(self, step: int, at: float) -> None:
        """Posted (no answer): step `step`'s vote completed at `at`; wake every driver."""
        self.clock.record(step, at)
        for n in self.nodes.values():
            n.wake.set()

    def cmd_progress(self, step: int) -> dict[str, Any]:
        live = [n for n in self.nodes.values() if n.node not in self.killed]
        return {
            "halted": [n.node for n in live if n.halted],
            "done": all(n.done_step >= step for n in live),
            "triggers": all(n.trigger is None or n.trigger.seen.get(step) is not None for n in live),
        }

    def cmd_steady(self) -> dict[str, Any]:
        """The failure-free samples: the drivers' timings, each trigger's arrival times."""
        t = self.timings
        triggers = [n.trigger for n in self.nodes.values() if n.trigger is not None]
        return {
            "requested": t.requested,
            "latest": t.latest,
            "publish": t.publish,
            "per_step": t.per_step,
            "lag": t.lag,
            "publish_at": t.publish_at,
            "seen": [dict(tr.seen) for tr in triggers],
            "trigger_events": sum(tr.events for tr in triggers),
            "progress_puts": sum(w.progress.puts for n in self.nodes.values() for w in n.workers),
        }

    # -- a generation change --------------------------------------------------------------------

    def _live_workers(self) -> list[SimWorker]:
        return [w for n in self._live() for w in n.workers]

    def cmd_change_status(self, generation: int) -> dict[str, bool]:
        live = self._live_workers()
        return {
            "seen": all(w.generations.latest() >= generation for w in live),
            "synced": all(w.synced_at is not None for w in live),
        }

    def cmd_change(self, generation: int) -> dict[str, Any]:
        """The live workers' abort, sync and `generation`-seen times, and that generation's record."""
        live = self._live_workers()
        return {
            "aborts": [w.abort.at for w in live if w.abort.at is not None],
            "synced": [w.synced_at for w in live if w.synced_at is not None],
            "seen": [w.generations.get(generation)[1] for w in live],
            "latest": max((w.generations.latest() for w in live), default=0),
            "record": live[0].generations.get(generation)[0].to_json() if live else None,
            "leases_lost": self._leases_lost(),
        }

    # -- teardown -------------------------------------------------------------------------------

    def cmd_teardown(self, stage: str) -> None:
        nodes = list(self.nodes.values())
        if stage == "stop_drivers":
            for n in nodes:
                n.stop.set()
                n.wake.set()
            in_parallel([n.stop_driver for n in nodes])
        elif stage == "close_workers":
            in_parallel([w.close for n in nodes for w in n.workers], threads=32)
        elif stage == "close_agents":
            in_parallel([n.close_agent for n in nodes], threads=32)
        else:
            self._end(stage, nodes)


def serve(conn: multiprocessing.connection.Connection, spec: ShardSpec) -> None:
    """Answer the parent's commands until told to exit or the pipe closes."""
    shard: Any
    if spec.light:
        from bench.control_plane_light_shard import LightShard

        shard = LightShard(spec)
    else:
        shard = Shard(spec)
    while not shard.exiting:
        try:
            seq, command, args = conn.recv()
        except (EOFError, OSError):
            log.error("shard %d: the parent's pipe closed; exiting", spec.index)
            return
        handler = getattr(shard, f"cmd_{command}", None)
        try:
            if handler is None:
                raise ValueError(f"unknown command {command!r}")
            value = handler(*args)
            status = "ok"
        except Exception:
            value, status = traceback.format_exc(), "error"
            log.error("shard %d: %s failed:\n%s", spec.index, command, value)
        if seq is not None:  # posted commands (ticks) are not answered
            try:
                conn.send((seq, status, value))
            except (EOFError, OSError):
                return


def shard_main(conn: multiprocessing.connection.Connection, spec: ShardSpec) -> None:
    """Entry point of a shard process (spawned)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s shard-{spec.index} %(name)s %(levelname)s %(message)s")
    set_grpc_poll(spec.grpc_poll_s)
    sys.setswitchinterval(spec.switch_interval_s)
    threading.stack_size(THREAD_STACK)
    code = 0
    try:
        serve(conn, spec)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        # gRPC and watch threads must not keep the process alive after its clients closed.
        os._exit(code)


# ---- the parent's side ---------------------------------------------------------------------


class ShardError(RuntimeError):
    """A shard failed a command, did not answer in time, or went away."""


class ShardHandle:
    """The parent's end of one shard: a spawned process (or, in_process, a thread of the parent)."""

    def __init__(self, spec: ShardSpec, *, in_process: bool = False) -> None:
        self.spec = spec
        self.index = spec.index
        self.broken = False
        self._seq = 0
        self.conn, child = multiprocessing.Pipe(duplex=True)
        self.process: multiprocessing.process.BaseProcess | None = None
        self.thread: threading.Thread | None = None
        if in_process:
            self.thread = threading.Thread(target=serve, args=(child, spec), name="shard-0", daemon=True)
            self.thread.start()
        else:
            ctx = multiprocessing.get_context("spawn")
            self.process = ctx.Process(target=shard_main, args=(child, spec), name=f"cp-shard-{spec.index}",
                                       daemon=True)
            self.process.start()
            child.close()  # the child holds its end; ours closing would show us its death as EOF

    @property
    def pid(self) -> int:
        return os.getpid() if self.process is None or self.process.pid is None else self.process.pid

    def send(self, command: str, *args: Any) -> int:
        """Send a request; its sequence number (for `receive`)."""
        if self.broken:
            raise ShardError(f"shard {self.index} is broken")
        self._seq += 1
        try:
            self.conn.send((self._seq, command, args))
        except (EOFError, OSError) as exc:
            self.broken = True
            raise ShardError(f"shard {self.index} (pid {self.pid}) is gone: {exc}") from exc
        return self._seq

    def post(self, command: str, *args: Any) -> None:
        """Send without an answer (ticks)."""
        try:
            self.conn.send((None, command, args))
        except (EOFError, OSError) as exc:
            self.broken = True
            raise ShardError(f"shard {self.index} (pid {self.pid}) is gone: {exc}") from exc

    def receive(self, seq: int, command: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                if left <= 0 or not self.conn.poll(left):
                    self.broken = True
                    raise ShardError(f"shard {self.index} (pid {self.pid}): no answer to {command} "
                                     f"within {timeout:.0f} s")
                got, status, value = self.conn.recv()
            except (EOFError, OSError) as exc:
                self.broken = True
                raise ShardError(f"shard {self.index} (pid {self.pid}) went away during {command}") from exc
            if got == seq:
                break  # (an older answer is one whose wait timed out: dropped)
        if status != "ok":
            raise ShardError(f"shard {self.index}: {command} failed:\n{value}")
        return value

    def call(self, command: str, *args: Any, timeout: float = 60.0) -> Any:
        return self.receive(self.send(command, *args), command, timeout)

    def join(self, timeout: float) -> None:
        """Wait for the shard to end; kill its process (by its PID) when it does not."""
        if self.process is not None:
            self.process.join(timeout)
            if self.process.is_alive():
                log.error("shard %d (pid %s) did not exit; killing it", self.index, self.process.pid)
                self.process.kill()
                self.process.join(5.0)
        elif self.thread is not None:
            self.thread.join(timeout)
        with contextlib.suppress(Exception):
            self.conn.close()


def call_all(shards: list[ShardHandle], command: str, *args: Any, timeout: float = 60.0) -> list[Any]:
    """`command` on every shard at once (sent to all, then each answer); answers in shard order."""
    seqs = [sh.send(command, *args) for sh in shards]
    return [sh.receive(seq, command, timeout) for sh, seq in zip(shards, seqs, strict=True)]


def teardown(shards: list[ShardHandle], *, graceful: bool = True, timeout: float = 60.0) -> None:
    """End every shard: `graceful`, each TEARDOWN_STAGES stage on every shard still answering (all
    within `timeout` s), else only "abort" (the run was interrupted, or etcd is gone: closing
    watches and leaving would only retry against it; the process just ends); then join each process, killing (by its
    PID) any still there 10 s later."""
    deadline = time.monotonic() + timeout
    try:
        for stage in TEARDOWN_STAGES if graceful else ("abort",):
            left = deadline - time.monotonic()
            if stage in ("exit", "abort"):
                left = max(left, 5.0)  # always asked for
            if left <= 0:
                log.error("teardown: out of time before %s", stage)
                continue
            sent = []
            for sh in shards:
                if not sh.broken:
                    with contextlib.suppress(ShardError):
                        sent.append((sh, sh.send("teardown", stage)))
            for sh, seq in sent:
                try:
                    sh.receive(seq, f"teardown {stage}", max(0.1, deadline - time.monotonic(), left))
                except ShardError as exc:
                    log.error("%s", exc)
    finally:
        end = time.monotonic() + 10.0
        for sh in shards:
            sh.join(timeout=max(0.1, end - time.monotonic()))
