"""Issue 13 part 3(c): the control plane at W simulated workers against a real etcd.

    .venv/bin/python bench/control_plane_scale.py --workers 8 64 256 1024 [--steps 100] [--json out.json]

What runs is the project's real code; only the training is simulated. Per W, one fresh etcd
(`EtcdServer`, 127.0.0.1) and a job in it:

- nodes: W / G simulated nodes (G = 8 workers a node, 2 for W < 32). Each node runs what its
  agent runs for the control plane: a real `Membership` lease (joined like `Agent.run`), a real
  `LeaderElection`, a real `Leader` (every agent starts one; only the elected one acts, the
  others keep their watches open as the real agent's do), the agent's `InjectionTrigger` (timed
  by a subclass that notes when each committed step reaches it) and the agent's watch on
  `injections/`. Not simulated: the agent's NodeMetrics endpoint, the worker monitor, processes.
- workers: each simulated worker registers `workers/<node>/<lr>` and `holdings/<node>/<lr>` on
  its node's lease and owns the feeds a real ElasticWorker owns (`GenerationFeed`, `HaltFeed`,
  `DecisionFeed`, `ProgressWriter`, each with its own watch stream and thread). There is no
  model and no gloo: the step's vote (the world all-reduce) is a clock tick, every `--pace-ms`
  ms. One driver thread a node runs, at each tick and for each of the node's workers, what
  `ElasticWorker._train` runs per step: commit, world rank 0's `ProgressWriter.publish`, then
  `HaltFeed.requested` and `GenerationFeed.latest` for the next step. An abort (the feeds call
  the abort flag the worker `enter`ed, as in `_reconfigure`) makes the driver write each of the
  node's workers' `SyncReport` with `write_sync`, as `_report_halted` does.
- the plan is the planner's: `gpt3-6.7b` on nominal devices of 128/G GiB (128 GiB a node), so
  every pipeline spans 2 nodes and a loss re-plans (the leader's `replan` merges the broken
  pipeline's survivor into another one), f = 1, 8 microbatches of 1 a node.
- etcd clients: one per node (its agent and its G workers share it, one gRPC channel carrying
  their watch streams), one for the bench's own reads and observer watches.

Per W it measures
1. failure-free steps: the per-step coordination calls of every worker (p50/p99 over workers and
   steps), the latency from rank 0's publish until each / every agent's trigger has the step,
   etcd writes, puts, ranges and watch events per step (etcd's /metrics before and after, and the
   revision), the same over an idle second before the steps (background: leases, elections, the
   leader's idle round), and the db size and key count after.
2. a generation change: every process of one node stops, then its member is reported failed
   (`Membership.report_failure`, the worker monitor's path); seconds from that moment to the
   leader's `halt/1` (seen by an observer watch), every live worker's abort, every live worker's
   sync report written, `plan/2` published, every live worker's GenerationFeed holding
   generation 2; and etcd writes / watch events / ranges for the change.
3. the group rendezvous of the new generation: `bench/rendezvous_scale.py`'s
   `rendezvous_seconds(endpoint, world)` when that file exists (on the same etcd, with the
   simulated job still up), else the figure is marked missing.

Everything is one Python process on a 2-core machine. gRPC's sync stream iterators wake every
0.1 s while idle (`grpc._common.MAXIMUM_WAIT_TIMEOUT`), which costs a real worker (3 streams)
30 wake-ups a second but this one process (thousands of streams) tens of thousands: the bench
raises that period to `--grpc-poll-s` (5 s; waits still end at once when notified, so nothing
is delayed), unless told 0.1 to see the difference.
 W workers' per-event work (decoding the
plan of g+1, writing sync reports) is serialised by the GIL, where real workers run it in
parallel in their own processes; `sim_lag_ms` says how late the drivers ran after each tick.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import logging
import os
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elastic.coordinator import (  # noqa: E402
    EtcdConfig,
    EtcdServer,
    JobKeys,
    LeaderElection,
    Membership,
    MembershipConfig,
    NodeIdentity,
    connect,
)
from elastic.coordinator.generations import Generations  # noqa: E402
from elastic.coordinator.watch import PrefixWatch, WatchEvent  # noqa: E402
from elastic.parallel.layout import ParallelLayout  # noqa: E402
from elastic.runtime.agent import InjectionTrigger  # noqa: E402
from elastic.runtime.control import DecisionFeed, GenerationFeed, HaltFeed, ProgressWriter, write_sync  # noqa: E402
from elastic.runtime.job import JobSpec  # noqa: E402
from elastic.runtime.leader import Leader  # noqa: E402
from elastic.runtime.planning import ClusterSpec, cluster_templates, initial_plan  # noqa: E402
from elastic.runtime.protocol import (  # noqa: E402
    ElasticConfig,
    GenerationRecord,
    RunKeys,
    StepResult,
    SyncReport,
    Vote,
    WorkerInfo,
    node_id,
)
from templates.plan import Plan  # noqa: E402

log = logging.getLogger("control_plane_scale")

MODEL = "gpt3-6.7b"
"""Model preset of the simulated job (planning only: nothing is trained)."""
NODE_MEMORY_GIB = 128.0
"""Nominal memory of one node; a pipeline of gpt3-6.7b then needs 2 nodes."""
MICROBATCHES_PER_NODE = 8
FAULT_TOLERANCE = 1
RENDEZVOUS_FILE = REPO / "bench" / "rendezvous_scale.py"
THREAD_STACK = 256 * 1024
"""Stack of each thread started here (8 MiB by default; W = 1024 runs ~10k threads)."""
SIM_LEASE_TTL = 10
"""Lease TTL (s) of the simulated members and elections. The runtime's default is 3 s; here one
process runs every node's keep-alive thread among thousands of others, and a starved keep-alive
would expire a healthy node (the loss under test is reported, so the TTL does not enter the
figures)."""
GRPC_POLL_S = 5.0
"""Idle wake-up period of gRPC's blocking stream iterators in this process (grpc's own: 0.1 s)."""

METRICS = (
    "etcd_mvcc_put_total",
    "etcd_mvcc_delete_total",
    "etcd_mvcc_txn_total",
    "etcd_mvcc_range_total",
    "etcd_debugging_mvcc_events_total",
    "etcd_debugging_mvcc_current_revision",
    "etcd_debugging_mvcc_watcher_total",
    "etcd_debugging_mvcc_watch_stream_total",
    "etcd_debugging_mvcc_slow_watcher_total",
    "etcd_debugging_mvcc_keys_total",
    "etcd_mvcc_db_total_size_in_bytes",
    "etcd_mvcc_db_total_size_in_use_in_bytes",
)


# ---- small helpers -------------------------------------------------------------------------


def etcd_metrics(endpoint: str) -> dict[str, float]:
    """The METRICS gauges and counters of etcd's /metrics."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10.0) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.partition(" ")
        if name in METRICS:
            out[name] = float(value)
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in METRICS}


def counts(d: dict[str, float], per: float = 1.0) -> dict[str, float]:
    """Writes (revisions), puts, deletes, txns, ranges and watch events in `d`, divided by `per`."""
    names = {
        "writes": "etcd_debugging_mvcc_current_revision",
        "puts": "etcd_mvcc_put_total",
        "deletes": "etcd_mvcc_delete_total",
        "txns": "etcd_mvcc_txn_total",
        "ranges": "etcd_mvcc_range_total",
        "watch_events": "etcd_debugging_mvcc_events_total",
    }
    return {k: round(d[v] / per, 3) for k, v in names.items()}


def pct(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile q (0-100) of `values`; NaN when empty."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, round(q / 100.0 * len(s) + 0.5) - 1))
    return s[k]


def summary(values: list[float], scale: float, digits: int = 3) -> dict[str, float]:
    """p50 / p99 / max of `values` times `scale`, rounded."""
    return {
        "p50": round(pct(values, 50) * scale, digits),
        "p99": round(pct(values, 99) * scale, digits),
        "max": round(max(values, default=float("nan")) * scale, digits),
        "n": len(values),
    }


def process_cpu() -> float:
    """CPU seconds (user + system) of this process so far: the bench, not etcd."""
    t = os.times()
    return t.user + t.system


def set_grpc_poll(seconds: float) -> None:
    """How often a thread blocked on a gRPC stream wakes up while idle (see the module doc)."""
    import grpc._common

    grpc._common.MAXIMUM_WAIT_TIMEOUT = seconds


def gpus_per_node(world: int) -> int:
    g = 8 if world >= 32 else 2
    if world % g:
        raise ValueError(f"W={world} is not a multiple of {g} workers a node")
    return g


def in_parallel(fns: list[Callable[[], Any]], threads: int = 16) -> list[Any]:
    """Run `fns` on a small pool (they block on etcd round trips), results in order."""
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(lambda f: f(), fns))


def wait_until(what: str, cond: Callable[[], bool], timeout: float, poll: float = 0.005) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout:.0f} s")
        time.sleep(poll)


# ---- the simulated pieces ------------------------------------------------------------------


class StepClock:
    """The step's vote: tick s means the world all-reduce of step s completed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.times: list[float] = []

    def tick(self) -> None:
        with self.lock:
            self.times.append(time.time())

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

    def set(self, reason: str) -> None:
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

    def _on_progress(self, events: list[WatchEvent]) -> None:
        super()._on_progress(events)
        now = time.time()
        self.events += len(events)
        committed = self.in_flight() - 2
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
    """One worker's control-plane side: registration, holdings, the feeds and the writer."""

    def __init__(self, node: SimNode, local_rank: int) -> None:
        self.node, self.local_rank = node, local_rank
        client, rk = node.client, node.rk
        info = WorkerInfo(pid=os.getpid(), transfer_address=f"127.0.0.1:{20000 + node.node * 64 + local_rank}",
                          incarnation=node.incarnation)  # fmt: skip
        client.put(rk.worker(node.node, local_rank), info.to_json(), lease=node.lease)
        self.generations = GenerationFeed(Generations(client, node.keys))
        self.halts = HaltFeed(client, rk)
        self.decisions = DecisionFeed(client, rk)
        self.progress = ProgressWriter(client, rk)
        self.abort = AbortFlag(node.wake)
        self.generation = 0
        self.rank = -1
        self.committed = 0
        self.last_vote: Vote | None = None
        self.synced_at: float | None = None

    def enter(self, generation: int) -> None:
        """What `_reconfigure` does with etcd: enter the feeds, write the holdings."""
        record, _ = self.generations.get(generation)
        layout = ParallelLayout(plan=record.plan, generation=generation, node=self.node.node,
                                local_rank=self.local_rank)  # fmt: skip
        self.generation, self.rank = generation, layout.rank
        self.generations.enter(generation, self.abort)
        self.halts.enter(generation, self.abort)
        held = json.dumps([[layer, self.local_rank] for layer in range(*layout.layers)])
        self.node.client.put(self.node.rk.worker_holdings(self.node.node, self.local_rank), held,
                             lease=self.node.lease)  # fmt: skip

    def step(self, s: int, t: Timings) -> None:
        """Step s's vote completed: commit it, then the checks `_train` makes before step s+1."""
        t0 = time.perf_counter()
        self.committed, self.last_vote = s + 1, Vote(step=s, grad_norm=1.0, loss=2.0)
        if self.rank == 0:
            now = time.time()
            result = StepResult(step=s, loss=2.0, grad_norm=1.0, lr=1e-4, seconds=0.02,
                                generation=self.generation, committed_at=now)  # fmt: skip
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
                            node=self.node.node, local_rank=self.local_rank)  # fmt: skip
        write_sync(self.node.client, self.node.rk, self.generation, report)
        self.synced_at = time.time()

    def close(self) -> None:
        self.progress.close(timeout=2.0)
        self.generations.close()
        self.halts.close()
        self.decisions.close()


class SimNode:
    """One node: its agent's control plane (member, election, leader, trigger) and G workers."""

    def __init__(self, client: Any, keys: JobKeys, config: ElasticConfig, node: int, gpus: int) -> None:
        self.client, self.keys, self.rk, self.config = client, keys, RunKeys(keys), config
        self.node, self.gpus, self.incarnation = node, gpus, 0
        self.who = node_id(node)
        self.membership = Membership(client, keys, NodeIdentity(node_id=self.who, incarnation=0,
                                     address=f"127.0.0.1:{10000 + node}", devices=gpus),
                                     config=MembershipConfig(ttl=config.lease_ttl))  # fmt: skip
        self.membership.join()
        assert self.membership.lease_id is not None
        self.lease: int = self.membership.lease_id
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
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def _drive(self, clock: StepClock, t: Timings) -> None:
        done = -1
        while not self.stop.is_set():
            self.wake.wait(0.5)
            self.wake.clear()
            if self.stop.is_set():
                return
            if not self.halted and any(w.abort.is_set() for w in self.workers):
                self.halted = True  # the in-flight step is abandoned; every worker reports
                for w in self.workers:
                    w.report_halted()
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
        if self.requests is not None:
            self.requests.cancel()
        if self.trigger is not None:
            self.trigger.close()
        if self.leader is not None:
            self.leader.stop()
        if self.election is not None:
            self.election.resign()
        self.requests = self.trigger = self.leader = self.election = None


# ---- one W -----------------------------------------------------------------------------------


class Observer:
    """The bench's own watches on `halt/` and `plan/`: when each key first arrived."""

    def __init__(self, client: Any, keys: JobKeys) -> None:
        self.seen: dict[str, float] = {}
        self._lock = threading.Lock()
        rev = int(client.get_prefix_response(keys.root, count_only=True).header.revision) + 1
        self.watches = [
            PrefixWatch(client, p, self._on, start_revision=rev) for p in (RunKeys(keys).halts, keys.plans)
        ]

    def _on(self, events: list[WatchEvent]) -> None:
        now = time.time()
        with self._lock:
            for ev in events:
                if ev.kind == "put":
                    self.seen.setdefault(ev.key, now)

    def at(self, key: str) -> float | None:
        with self._lock:
            return self.seen.get(key)

    def close(self) -> None:
        for w in self.watches:
            w.cancel()


def make_config(world: int, run_dir: str) -> tuple[ElasticConfig, Plan]:
    gpus = gpus_per_node(world)
    nodes = world // gpus
    cluster = ClusterSpec(model=MODEL, nodes=nodes, gpus_per_node=gpus, fault_tolerance=FAULT_TOLERANCE,
                          global_batch=MICROBATCHES_PER_NODE * nodes, microbatch=1,
                          device_memory_gib=NODE_MEMORY_GIB / gpus)  # fmt: skip
    plan = initial_plan(cluster, cluster_templates(cluster))
    spec = JobSpec(model=MODEL, plan=plan, steps=10**6, run_dir=run_dir, device="cpu")
    config = ElasticConfig(spec=spec, cluster=cluster, checkpoint_every=0,
                           checkpoint_dir=str(Path(run_dir) / "ckpt"), lease_ttl=SIM_LEASE_TTL)  # fmt: skip
    return config, plan


def rendezvous_figure(endpoint: str, world: int) -> dict[str, Any]:
    """HOOK (part 3): bench/rendezvous_scale.py's `rendezvous_seconds(endpoint, world)`, when
    that file exists; otherwise a dict saying it is missing."""
    if not RENDEZVOUS_FILE.exists():
        return {"status": "missing: bench/rendezvous_scale.py not found (hook in rendezvous_figure)"}
    spec = importlib.util.spec_from_file_location("bench_rendezvous_scale", RENDEZVOUS_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        t0 = time.perf_counter()
        result = module.rendezvous_seconds(endpoint, world, repeats=1)
        out = dict(result) if isinstance(result, dict) else {"seconds": result}
        out.setdefault("status", "ok")
        out["call_wall_s"] = round(time.perf_counter() - t0, 3)
        return json.loads(json.dumps(out, default=str))
    except Exception as exc:  # report, do not lose the other figures
        return {"status": f"failed: {type(exc).__name__}: {exc}"}


def run_one(
    world: int,
    *,
    steps: int = 100,
    pace_ms: float = 20.0,
    rendezvous: bool = True,
    standby_leaders: bool = True,
) -> dict[str, Any]:
    """Everything for one W (see the module doc); JSON-serialisable."""
    wall0 = time.perf_counter()
    gpus = gpus_per_node(world)
    n_nodes = world // gpus
    out: dict[str, Any] = {"workers": world, "nodes": n_nodes, "gpus_per_node": gpus, "model": MODEL,
                           "etcd_clients": n_nodes + 1, "steps": steps, "pace_ms": pace_ms, "standby_leaders": standby_leaders}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="cp-scale-") as run_dir, EtcdServer() as server:
        endpoint = server.endpoint
        admin = connect(EtcdConfig(endpoint=endpoint))
        keys = JobKeys(f"scale-{world}")
        rk = RunKeys(keys)
        config, plan = make_config(world, run_dir)
        out["plan"] = {"pipelines": len(plan.pipelines),
                       "stages_per_pipeline": sorted({len(p.stages) for p in plan.pipelines}),
                       "json_bytes": len(plan.to_json())}  # fmt: skip
        admin.put(rk.config, config.to_json())
        nodes: list[SimNode] = []
        clients: list[Any] = []
        observer: Observer | None = None
        try:
            # -- setup: members, workers (registrations, feeds), generation 1, agents ----------
            t0 = time.perf_counter()
            clients = [connect(EtcdConfig(endpoint=endpoint)) for _ in range(n_nodes)]
            nodes = in_parallel(
                [functools.partial(SimNode, clients[n], keys, config, n, gpus) for n in range(n_nodes)]
            )
            first = GenerationRecord(plan=plan, resume_step=0, incarnations=dict.fromkeys(range(n_nodes), 0))
            Generations(admin, keys).publish(first.to_json(), expected=0)
            log.info("W=%d: %d members joined (%.1f s)", world, n_nodes, time.perf_counter() - t0)
            in_parallel([n.start_workers for n in nodes])
            log.info("W=%d: workers' feeds up (%.1f s)", world, time.perf_counter() - t0)
            in_parallel([functools.partial(w.enter, 1) for n in nodes for w in n.workers])
            log.info("W=%d: workers entered generation 1 (%.1f s)", world, time.perf_counter() - t0)
            nodes[0].start_agent()  # node 0's election goes first: it leads
            assert nodes[0].election is not None and nodes[0].election.wait_leader(10.0)
            in_parallel([functools.partial(n.start_agent, standby_leaders) for n in nodes[1:]])
            leader = nodes[0].leader
            assert leader is not None
            wait_until("the leader's first round", lambda: leader.rounds >= 1, 30.0)
            out["setup_s"] = round(time.perf_counter() - t0, 2)
            out["threads"] = threading.active_count()
            m = etcd_metrics(endpoint)
            out["watchers"] = int(m["etcd_debugging_mvcc_watcher_total"])
            out["watch_streams"] = int(m["etcd_debugging_mvcc_watch_stream_total"])

            # -- 1. failure-free steps -----------------------------------------------------------
            time.sleep(0.5)
            idle0, cpu0 = etcd_metrics(endpoint), process_cpu()
            time.sleep(2.0)
            idle1, cpu1 = etcd_metrics(endpoint), process_cpu()
            background = counts(delta(idle1, idle0), per=2.0)
            clock, timings = StepClock(), Timings()
            for n in nodes:
                n.run(clock, timings)
            before, cpu2 = etcd_metrics(endpoint), process_cpu()
            start = time.perf_counter()
            for s in range(steps):
                time.sleep(max(0.0, start + (s + 1) * pace_ms / 1e3 - time.perf_counter()))
                clock.tick()
                for n in nodes:
                    n.wake.set()
            run_s = time.perf_counter() - start
            cpu3 = process_cpu()
            triggers = [n.trigger for n in nodes if n.trigger is not None]

            def settled() -> bool:
                if any(n.halted for n in nodes):
                    raise RuntimeError(
                        "a generation was halted during the failure-free steps (a lease expired?)"
                    )
                return all(n.done_step >= steps - 1 for n in nodes)

            wait_until("every driver at the last step", settled, 60.0)
            wait_until(
                "every trigger at the last step", lambda: all(t.seen.get(steps - 1) for t in triggers), 60.0
            )
            after = etcd_metrics(endpoint)
            per_step = counts(delta(after, before), per=steps)
            seen_each: list[float] = []
            seen_all: list[float] = []
            for s in range(steps):
                published = timings.publish_at[s]
                lat = [t.seen[s] - published for t in triggers]
                seen_each.extend(lat)
                seen_all.append(max(lat))
            job_keys = int(admin.get_prefix_response(keys.root, count_only=True).count)
            out["steady"] = {
                "ticks_s": round(run_s, 3),
                "requested_us": summary(timings.requested, 1e6, 1),
                "latest_us": summary(timings.latest, 1e6, 1),
                "publish_us": summary(timings.publish, 1e6, 1),
                "coordination_us": summary(timings.per_step, 1e6, 1),
                "agents_seen_all_ms": summary(seen_all, 1e3, 2),
                "agent_seen_each_ms": summary(seen_each, 1e3, 2),
                "per_step": per_step,
                "trigger_events_per_step": round(sum(t.events for t in triggers) / steps, 2),
                "progress_puts": sum(w.progress.puts for n in nodes for w in n.workers),
                "background_per_s": background,
                "sim_lag_ms": summary(timings.lag, 1e3, 2),
                "bench_cpu_idle": round((cpu1 - cpu0) / 2.0, 2),
                "bench_cpu_steps": round((cpu3 - cpu2) / run_s, 2),
                "db_bytes": int(after["etcd_mvcc_db_total_size_in_bytes"]),
                "db_in_use_bytes": int(after["etcd_mvcc_db_total_size_in_use_in_bytes"]),
                "job_keys": job_keys,
            }

            # -- 2. a generation change ----------------------------------------------------------
            rank0_node = plan.pipelines[0].stages[0].node
            victim = next(n for n in reversed(nodes) if n.node not in (0, rank0_node))
            live = [n for n in nodes if n is not victim]
            observer = Observer(admin, keys)
            victim.kill()
            rounds0 = leader.rounds
            before = etcd_metrics(endpoint)
            t_fail = time.time()
            assert victim.membership.report_failure(reason="bench: simulated node failure")
            live_workers = [w for n in live for w in n.workers]
            wait_until("generation 2 on every live worker",
                       lambda: all(w.generations.latest() >= 2 for w in live_workers), 120.0)  # fmt: skip
            wait_until(
                "every live worker's sync report", lambda: all(w.synced_at for w in live_workers), 30.0
            )
            wait_until(
                "the observer", lambda: observer is not None and observer.at(keys.plan(2)) is not None, 30.0
            )
            t_done = time.time()
            time.sleep(1.0)  # the leader's round after the publish, late watch deliveries
            after = etcd_metrics(endpoint)
            record, _ = live_workers[0].generations.get(2)
            halt_at = observer.at(rk.halt(1))
            plan_at = observer.at(keys.plan(2))
            assert halt_at is not None and plan_at is not None
            aborts = [w.abort.at for w in live_workers if w.abort.at is not None]
            synced = [w.synced_at for w in live_workers if w.synced_at is not None]
            seen = [w.generations.get(2)[1] for w in live_workers]
            out["change"] = {
                "lost_node": victim.node,
                "lost_in_record": record.lost,
                "valid": record.lost == [victim.node]
                and max(w.generations.latest() for w in live_workers) == 2,
                "new_plan": {
                    "pipelines": len(record.plan.pipelines),
                    "stages_per_pipeline": sorted({len(p.stages) for p in record.plan.pipelines}),
                    "reason": record.reason[:120],
                },  # fmt: skip
                "detected_s": round((record.detected_at or t_fail) - t_fail, 4),
                "halt_written_s": round(halt_at - t_fail, 4),
                "halt_seen_all_s": round(max(aborts) - t_fail, 4),
                "syncs_written_s": round(max(synced) - t_fail, 4),
                "published_s": round(plan_at - t_fail, 4),
                "leader_published_at_s": round((record.published_at or t_fail) - t_fail, 4),
                "all_seen_s": round(max(seen) - t_fail, 4),
                "seen_p50_s": round(pct(seen, 50) - t_fail, 4),
                "measured_until_s": round(t_done - t_fail, 4),
                "leader_rounds": leader.rounds - rounds0,
                "etcd": counts(delta(after, before)),
            }

            # -- 3. the new generation's rendezvous --------------------------------------------
            out["rendezvous"] = rendezvous_figure(endpoint, world) if rendezvous else {"status": "skipped"}
            final = etcd_metrics(endpoint)
            out["db_bytes_end"] = int(final["etcd_mvcc_db_total_size_in_bytes"])
        finally:
            t0 = time.perf_counter()
            if observer is not None:
                observer.close()
            for n in nodes:
                n.stop.set()
                n.wake.set()
            in_parallel([n.stop_driver for n in nodes])
            in_parallel([w.close for n in nodes for w in n.workers], threads=32)
            in_parallel([n.close_agent for n in nodes], threads=32)
            in_parallel([n.membership.leave for n in nodes], threads=32)
            for c in [*clients, admin]:
                with contextlib.suppress(Exception):
                    c.close()
            out["teardown_s"] = round(time.perf_counter() - t0, 2)
    out["wall_s"] = round(time.perf_counter() - wall0, 2)
    return out


def run_scale(
    worlds: list[int],
    *,
    steps: int = 100,
    pace_ms: float = 20.0,
    rendezvous: bool = True,
    grpc_poll_s: float = GRPC_POLL_S,
    standby_leaders: bool = True,
) -> list[dict]:
    """One dict per W in `worlds` (see `run_one`)."""
    set_grpc_poll(grpc_poll_s)
    threading.stack_size(THREAD_STACK)
    results = []
    for world in worlds:
        log.info("W=%d ...", world)
        try:
            results.append(
                run_one(
                    world,
                    steps=steps,
                    pace_ms=pace_ms,
                    rendezvous=rendezvous,
                    standby_leaders=standby_leaders,
                )
            )
        except Exception as exc:  # a W that does not hold is a result too
            log.exception("W=%d failed", world)
            results.append({"workers": world, "error": f"{type(exc).__name__}: {exc}"})
        log.info("W=%d done: %s", world, json.dumps(results[-1])[:400])
    return results


# ---- the table -----------------------------------------------------------------------------

COLUMNS: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
    ("W", lambda r: r["workers"]),
    ("nodes", lambda r: r["nodes"]),
    (
        "coord us p50/p99",
        lambda r: f"{r['steady']['coordination_us']['p50']:g}/{r['steady']['coordination_us']['p99']:g}",
    ),
    (
        "publish us p50/p99",
        lambda r: f"{r['steady']['publish_us']['p50']:g}/{r['steady']['publish_us']['p99']:g}",
    ),
    (
        "->all agents ms p50/p99",
        lambda r: (
            f"{r['steady']['agents_seen_all_ms']['p50']:g}/{r['steady']['agents_seen_all_ms']['p99']:g}"
        ),
    ),
    ("writes/step", lambda r: r["steady"]["per_step"]["writes"]),
    ("events/step", lambda r: r["steady"]["per_step"]["watch_events"]),
    ("ranges/step", lambda r: r["steady"]["per_step"]["ranges"]),
    ("db KiB", lambda r: r["steady"]["db_bytes"] // 1024),
    ("halt s", lambda r: r["change"]["halt_written_s"]),
    ("syncs s", lambda r: r["change"]["syncs_written_s"]),
    ("g+1 s", lambda r: r["change"]["published_s"]),
    ("seen s", lambda r: r["change"]["all_seen_s"]),
    ("chg writes", lambda r: int(r["change"]["etcd"]["writes"])),
    ("chg events", lambda r: int(r["change"]["etcd"]["watch_events"])),
    ("chg ranges", lambda r: int(r["change"]["etcd"]["ranges"])),
    ("rdzv s", lambda r: r["rendezvous"].get("seconds", r["rendezvous"].get("status", "?"))),
    ("lag ms p99", lambda r: r["steady"]["sim_lag_ms"]["p99"]),
    ("wall s", lambda r: r["wall_s"]),
]


def table(results: list[dict]) -> str:
    rows = [[name for name, _ in COLUMNS]]
    for r in results:
        if "error" in r:
            rows.append([str(r["workers"]), "ERROR: " + r["error"]] + [""] * (len(COLUMNS) - 2))
            continue
        cells = []
        for _, get in COLUMNS:
            try:
                v = get(r)
            except (KeyError, TypeError):
                v = "-"
            cells.append(str(v)[:40])
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 64, 256, 1024], help="values of W")
    ap.add_argument("--steps", type=int, default=100, help="failure-free steps per W")
    ap.add_argument("--pace-ms", type=float, default=20.0, help="one simulated step every this many ms")
    ap.add_argument("--no-rendezvous", action="store_true", help="skip part 3 (bench/rendezvous_scale.py)")
    ap.add_argument("--grpc-poll-s", type=float, default=GRPC_POLL_S,
                    help="idle wake-up period of gRPC stream threads (grpc's default: 0.1)")  # fmt: skip
    ap.add_argument("--no-standby-leaders", action="store_true",
                    help="only the elected agent runs a Leader (the real agents all do; shows their watch fan-out)")  # fmt: skip
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("-v", "--verbose", action="store_true", help="the runtime's warnings (halts, publishes)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.verbose else logging.ERROR,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")  # fmt: skip
    log.setLevel(logging.INFO)
    t0 = time.perf_counter()
    results = run_scale(args.workers, steps=args.steps, pace_ms=args.pace_ms, rendezvous=not args.no_rendezvous,
                        grpc_poll_s=args.grpc_poll_s, standby_leaders=not args.no_standby_leaders)  # fmt: skip
    total = time.perf_counter() - t0
    print(table(results))
    print(f"total wall time {total:.1f} s; etcd clients = nodes + 1 (one per node, shared by its agent "
          f"and its workers); coord = HaltFeed.requested + GenerationFeed.latest (+ rank 0's publish) per "
          f"worker-step")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"results": results, "wall_s": round(total, 2)}, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
