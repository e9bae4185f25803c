"""Issue 13 part 3(c): the control plane at W simulated workers against a real etcd.

    .venv/bin/python bench/control_plane_scale.py --workers 8 64 256 1024 [--steps 100] [--procs P] [--json out.json]

What runs is the project's real code; only the training is simulated. Per W, one fresh etcd
(`EtcdServer`, 127.0.0.1) and a job in it:

- nodes: W / G simulated nodes (G = 8 workers a node, 2 for W < 32). Each node runs what its
  agent runs for the control plane: a real `Membership` lease (joined like `Agent.run`), a real
  `LeaderElection`, a real `Leader` (every agent starts one; only the elected one acts, the
  others keep their watches open as the real agent's do), the agent's `InjectionTrigger` (timed
  by a subclass that notes when each committed step reaches it) and the agent's watch on
  `injections/`. Not simulated: the agent's NodeMetrics endpoint, the worker monitor, processes.
- workers: each simulated worker registers in `workers/<node>/all` (through the node's relay) on
  its node's lease and owns the feeds a real ElasticWorker owns (`GenerationFeed`, `HaltFeed`,
  `DecisionFeed`, `ProgressWriter`). The three feeds follow their prefixes through the node's
  relay, as an ElasticWorker's do (the agent watches each prefix once for its node,
  elastic/roles/node_feed.py); with `--no-relay` each is a watch of the worker's own. Every
  watch of an etcd client rides that client's one Watch stream (elastic/coordinator/watch_stream.py). There is no
  model and no gloo: the step's vote (the world all-reduce) is a clock tick, every `--pace-ms`
  ms. One driver thread a node runs, at each tick and for each of the node's workers, what
  `ElasticWorker._train` runs per step: commit, world rank 0's `ProgressWriter.publish`, then
  `HaltFeed.requested` and `GenerationFeed.latest` for the next step. An abort (the feeds call
  the abort flag the worker `enter`ed, as in `_reconfigure`) makes the driver write each of the
  node's workers' `SyncReport` with `write_sync`, as `_report_halted` does (side by side, as
  workers in processes of their own do), and the survivors then enter generation 2 and write
  their recovery records (the first commit's). The sync report carries the worker's holdings in
  the same request (`write_sync`), as in the runtime. Both go through the node's `NodeRelay` (elastic/roles/node_relay.py: the agent
  writes its workers' reports as one transaction), as in the runtime; `--no-relay` has each
  worker put its own and watch for itself, as before issue 34.
- the plan is the planner's: `gpt3-6.7b` on nominal devices of 128/G GiB (128 GiB a node), so
  every pipeline spans 2 nodes and a loss re-plans (the leader's `replan` merges the broken
  pipeline's survivor into another one), f = 1, 8 microbatches of 1 a node.
- etcd clients: one per node (its agent and its G workers share it, one gRPC channel and one
  Watch stream carrying all their watches), one for the bench's own reads and observer watches.

Processes (`--procs P`). The nodes are spread over P shard processes (bench/control_plane_shard.py,
started with multiprocessing's "spawn": gRPC's threads do not survive a fork), in contiguous
blocks, node 0 (elected first, so it leads) in shard 0. A shard hosts its nodes whole, as the
one-process bench did: their etcd clients, members, elections, Leaders, triggers, the workers'
feeds and writers, and the drivers. The parent keeps the etcd server, its own client (the
config, generation 1, key counts), the observer watches, the step clock, the failure's
orchestration, the rendezvous figure and every metric; it commands the shards over one pipe
each. The tick of step s is a message from the parent to every shard carrying the parent's wall
time; a shard records it and wakes its drivers, so `sim_lag_ms` (driver time minus tick time)
includes that hop. Times taken in a shard (trigger arrivals, aborts, sync reports, a generation
seen, the moment of the failure report) are `time.time()` of the same host, so they compare with
the parent's. Default P: 1 up to W = 64, else enough for at most 16 nodes and 128 workers a
process (2 at W = 256, 8 at W = 1024); `--procs 0` runs the single shard as a thread of the
parent (the one-process layout of earlier versions of this bench).

Per W it measures
1. failure-free steps: the per-step coordination calls of every worker (p50/p99 over workers and
   steps), the latency from rank 0's publish until each / every agent's trigger has the step,
   etcd writes, puts, ranges and watch events per step (etcd's /metrics before and after, and the
   revision), the same over an idle second before the steps (background: leases, elections, the
   leader's idle round), the db size and key count after, and the cores busy during the idle
   seconds and the steps (`cores_*`: the bench, i.e. the parent and every shard; etcd; the
   whole machine, which shows any other load on it; `bench_cpu_*` is the bench's).
2. a generation change: every process of one node stops, then its member is reported failed
   (`Membership.report_failure`, the worker monitor's path, run in that node's shard); seconds
   from that moment to the leader's `halt/1` (seen by the parent's observer watch), every live
   worker's abort, every live worker's sync report written, `plan/2` published, every live
   worker's GenerationFeed holding generation 2 (also the latest of each shard); etcd writes /
   watch events / ranges for the change (until every survivor has written its recovery record of
   generation 2, `entered_s` after it had the generation; `writes_by_family` breaks the writes
   down by the key families each revision touched), and the cores busy until every live worker had it.
3. the group rendezvous of the new generation: `bench/rendezvous_scale.py`'s
   `rendezvous_seconds(endpoint, world)` when that file exists (on the same etcd, with the
   simulated job still up; its W ranks are threads of the parent), else the figure is marked
   missing.

What is still serialised, unlike a real cluster: every process (the parent, the P shards, etcd)
shares this machine's 2 cores; inside a shard, the work of its up to 128 workers (feed
callbacks, decoding the plan of g+1, writing sync reports) is serialised by that process's GIL
where real workers run it in parallel in their own processes, and a node's driver steps its G
workers one after another; the rendezvous figure's W ranks share the parent's GIL. gRPC's sync
stream iterators wake every 0.1 s while idle (`grpc._common.MAXIMUM_WAIT_TIMEOUT`), which costs a
real worker (3 streams) 30 wake-ups a second but a shard (a thousand streams or more) tens of
thousands: every process of the bench raises that period to `--grpc-poll-s` (5 s; waits still end
at once when notified, so nothing is delayed), unless told 0.1 to see the difference. Likewise
CPython forces a GIL switch every 5 ms: in a shard of ~900 threads, a node's 8 workers decoding
the plan of g+1 at once (as they do when their agent hands it to them together) were sliced by
it to 3x the CPU of one decode alone (8.8 against 3.0 ms each, measured at W = 1024), which a
real worker, alone in its process, never pays. Every shard raises that period to
`--switch-interval-ms` (50 ms), unless told 5 to see the difference.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import math
import os
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.control_plane_shard import (  # noqa: E402
    THREAD_STACK,
    ShardHandle,
    ShardSpec,
    call_all,
    process_cpu,
    set_grpc_poll,
    teardown,
)
from bench.section import exit_on_sigterm  # noqa: E402
from elastic.coordinator import EtcdConfig, EtcdServer, JobKeys, connect  # noqa: E402
from elastic.coordinator.generations import Generations  # noqa: E402
from elastic.coordinator.keys import RunKeys  # noqa: E402
from elastic.coordinator.watch import PrefixWatch, WatchEvent  # noqa: E402
from elastic.planning.cluster import ClusterSpec, cluster_templates, initial_plan  # noqa: E402
from elastic.records.config import ElasticConfig  # noqa: E402
from elastic.records.generation import GenerationRecord  # noqa: E402
from elastic.records.job import JobSpec  # noqa: E402
from templates.plan import Plan  # noqa: E402

log = logging.getLogger("control_plane_scale")

MODEL = "gpt3-6.7b"
"""Model preset of the simulated job (planning only: nothing is trained)."""
NODE_MEMORY_GIB = 128.0
"""Nominal memory of one node; a pipeline of gpt3-6.7b then needs 2 nodes."""
MICROBATCHES_PER_NODE = 8
FAULT_TOLERANCE = 1
RENDEZVOUS_FILE = REPO / "bench" / "rendezvous_scale.py"
SIM_LEASE_TTL = 20
"""Lease TTL (s) of the simulated members and elections. The runtime's default is 3 s; here one
process runs many nodes' keep-alive threads among a thousand others, and a starved keep-alive
would expire a healthy node (the loss under test is reported, so the TTL does not enter the
figures)."""
SWITCH_INTERVAL_MS = 50.0
"""CPython's forced GIL switch period in every shard (CPython's own: 5 ms)."""
GRPC_POLL_S = 5.0
"""Idle wake-up period of gRPC's blocking stream iterators in every process of the bench
(grpc's own: 0.1 s)."""
NODES_PER_PROC = 16
WORKERS_PER_PROC = 128
"""The default `--procs` keeps each shard process at most this many nodes and workers."""
SETUP_TIMEOUT_S = 600.0
"""Longest wait for one setup command on every shard (members, workers' feeds, agents)."""

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


def gpus_per_node(world: int) -> int:
    g = 8 if world >= 32 else 2
    if world % g:
        raise ValueError(f"W={world} is not a multiple of {g} workers a node")
    return g


def default_procs(world: int) -> int:
    """Shard processes for W workers: 1 up to W = 64, else at most NODES_PER_PROC nodes and
    WORKERS_PER_PROC workers a process."""
    if world <= 64:
        return 1
    nodes = world // gpus_per_node(world)
    return max(math.ceil(nodes / NODES_PER_PROC), math.ceil(world / WORKERS_PER_PROC))


def split_nodes(n_nodes: int, shards: int) -> list[tuple[int, ...]]:
    """Contiguous blocks of nodes, as even as can be; node 0 in the first."""
    return [tuple(range(i * n_nodes // shards, (i + 1) * n_nodes // shards)) for i in range(shards)]


def wait_until(what: str, cond: Callable[[], bool], timeout: float, poll: float = 0.005) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout:.0f} s")
        time.sleep(poll)


# ---- one W -----------------------------------------------------------------------------------


def family(root: str, key: str) -> str:
    """The schema family of a job key: its first component under the job's root."""
    return key[len(root):].split("/", 1)[0]


def by_family(revisions: Iterable[set[str]]) -> dict[str, int]:
    """Revisions (etcd writes) counted by the key families each one touched (a transaction of
    two families counts under "a+b")."""
    out: dict[str, int] = {}
    for fams in revisions:
        name = "+".join(sorted(fams))
        out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


class Observer:
    """The bench's own watches on `halt/` and `plan/` (and `also`): when each key first arrived;
    with `families`, one on the job's whole prefix: which key families each revision wrote
    (`writes_by_family`)."""

    def __init__(self, client: Any, keys: JobKeys, *, families: bool = True, also: tuple[str, ...] = ()) -> None:
        self.seen: dict[str, float] = {}
        self.root = keys.root
        self.families: dict[int, set[str]] = {}
        self._lock = threading.Lock()
        rev = int(client.get_prefix_response(keys.root, count_only=True).header.revision) + 1
        self.watches = [
            PrefixWatch(client, p, self._on, start_revision=rev) for p in (RunKeys(keys).halts, keys.plans, *also)
        ]
        if families:
            self.watches.append(PrefixWatch(client, keys.root, self._on_any, start_revision=rev))

    def _on(self, events: list[WatchEvent]) -> None:
        now = time.time()
        with self._lock:
            for ev in events:
                if ev.kind == "put":
                    self.seen.setdefault(ev.key, now)

    def _on_any(self, events: list[WatchEvent]) -> None:
        with self._lock:
            for ev in events:
                name = family(self.root, ev.key) + ("" if ev.kind == "put" else " (delete)")
                self.families.setdefault(ev.revision, set()).add(name)

    def writes_by_family(self) -> dict[str, int]:
        """Revisions (etcd writes) seen under the job's prefix, by the key families each one touched."""
        with self._lock:
            return by_family(self.families.values())

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
                          device_memory_gib=NODE_MEMORY_GIB / gpus)
    plan = initial_plan(cluster, cluster_templates(cluster))
    spec = JobSpec(model=MODEL, plan=plan, steps=10**6, run_dir=run_dir, device="cpu")
    config = ElasticConfig(spec=spec, cluster=cluster, checkpoint_every=0,
                           checkpoint_dir=str(Path(run_dir) / "ckpt"), lease_ttl=SIM_LEASE_TTL)
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


def proc_cpu(pid: int | None) -> float:
    """CPU seconds (user + system) of process `pid` so far (/proc; 0 when it cannot be read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def host_cpu() -> float:
    """CPU seconds every core of this machine spent busy so far (/proc/stat: all but idle and
    iowait), whoever used them: the bench, etcd, and anything else running here."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    except (OSError, ValueError):
        return 0.0
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def bench_usage(shards: list[ShardHandle]) -> tuple[float, list[int]]:
    """CPU seconds so far of the parent and every shard process, and the threads of each
    (parent first); a shard running as a thread of the parent (procs 0) is not counted twice."""
    usage = call_all(shards, "usage")
    external = [u for sh, u in zip(shards, usage, strict=True) if sh.process is not None]
    threads = [threading.active_count()] + [u["threads"] for u in external]
    return process_cpu() + sum(u["cpu"] for u in external), threads


def cpu_now(shards: list[ShardHandle], etcd_pid: int | None) -> dict[str, float]:
    """CPU seconds so far: the bench (parent and shards), etcd, the whole machine."""
    bench, _ = bench_usage(shards)
    return {"bench": bench, "etcd": proc_cpu(etcd_pid), "host": host_cpu()}


def cores(after: dict[str, float], before: dict[str, float], seconds: float) -> dict[str, float]:
    """Cores busy on average between two `cpu_now`s `seconds` apart."""
    return {k: round((after[k] - before[k]) / seconds, 2) for k in after}


def concat(parts: list[dict[str, Any]], name: str) -> list[Any]:
    """The lists `name` of every shard's answer, one after another."""
    return [v for p in parts for v in p[name]]


@dataclass(frozen=True, kw_only=True)
class ShardLayout:
    """How one W's nodes are spread over shard processes."""

    world: int
    """Simulated workers."""
    gpus: int
    """Workers a node."""
    n_nodes: int
    """Simulated nodes."""
    in_process: bool
    """Whether the single shard runs as a thread of this process (`--procs 0`)."""
    blocks: list[tuple[int, ...]]
    """The nodes of each shard, contiguous, node 0 in the first."""

    @classmethod
    def of(cls, world: int, procs: int | None) -> ShardLayout:
        """The layout of W = `world` over `procs` shard processes (None: `default_procs(world)`;
        0: one shard, a thread of this process); never more shards than nodes."""
        gpus = gpus_per_node(world)
        n_nodes = world // gpus
        procs = default_procs(world) if procs is None else procs
        if procs < 0:
            raise ValueError(f"procs must be >= 0, got {procs}")
        in_process = procs == 0
        n_shards = 1 if in_process else min(procs, n_nodes)
        return cls(world=world, gpus=gpus, n_nodes=n_nodes, in_process=in_process,
                   blocks=split_nodes(n_nodes, n_shards))

    @property
    def n_shards(self) -> int:
        return len(self.blocks)

    @property
    def shard_of(self) -> dict[int, int]:
        """Node -> index of the shard that hosts it."""
        return {n: i for i, block in enumerate(self.blocks) for n in block}


class ScaleRun:
    """One W's simulated job on a fresh etcd: the bench's own client, the shards that host the
    nodes, and the measured phases (setup, failure-free steps, a generation change)."""

    def __init__(self, layout: ShardLayout, *, server: EtcdServer, run_dir: str, grpc_poll_s: float,
                 relay: bool = True, switch_interval_ms: float = SWITCH_INTERVAL_MS) -> None:
        self.layout = layout
        self.relay = relay
        self.server = server
        self.endpoint = server.endpoint
        self.grpc_poll_s = grpc_poll_s
        self.switch_interval_s = switch_interval_ms / 1000
        self.admin = connect(EtcdConfig(endpoint=self.endpoint))
        self.keys = JobKeys(f"scale-{layout.world}")
        self.rk = RunKeys(self.keys)
        self.config, self.plan = make_config(layout.world, run_dir)
        self.shards: list[ShardHandle] = []
        self.observer: Observer | None = None

    def plan_figures(self) -> dict[str, Any]:
        """The shape of the job's plan."""
        return {"pipelines": len(self.plan.pipelines),
                "stages_per_pipeline": sorted({len(p.stages) for p in self.plan.pipelines}),
                "json_bytes": len(self.plan.to_json())}

    def leader_rounds(self) -> int:
        """Rounds the leader (node 0's, in shard 0) has run so far."""
        return int(self.shards[0].call("leader_rounds", 0))

    def setup(self, *, standby_leaders: bool) -> dict[str, Any]:
        """Shard processes, members, workers (registrations, feeds), generation 1, agents; the
        setup's figures (shard PIDs, seconds, threads, etcd watchers)."""
        layout, world = self.layout, self.layout.world
        out: dict[str, Any] = {}
        t0 = time.perf_counter()
        level = logging.getLogger().getEffectiveLevel()
        for i, block in enumerate(layout.blocks):
            spec = ShardSpec(index=i, endpoint=self.endpoint, job=self.keys.job,
                             config_json=self.config.to_json(), nodes=block, gpus=layout.gpus,
                             grpc_poll_s=self.grpc_poll_s, switch_interval_s=self.switch_interval_s,
                             relay=self.relay, log_level=level)
            self.shards.append(ShardHandle(spec, in_process=layout.in_process))
        first_shard = self.shards[0]
        setups = call_all(self.shards, "setup", timeout=SETUP_TIMEOUT_S)
        out["shard_pids"] = [s["pid"] for s in setups]
        first = GenerationRecord(plan=self.plan, resume_step=0, incarnations=dict.fromkeys(range(layout.n_nodes), 0))
        Generations(self.admin, self.keys).publish(first.to_json(), expected=0)
        log.info("W=%d: %d members joined in %d shard(s) (%.1f s)", world, layout.n_nodes, layout.n_shards,
                 time.perf_counter() - t0)
        call_all(self.shards, "start_workers", timeout=SETUP_TIMEOUT_S)
        log.info("W=%d: workers' feeds up (%.1f s)", world, time.perf_counter() - t0)
        call_all(self.shards, "enter", 1, timeout=SETUP_TIMEOUT_S)
        log.info("W=%d: workers entered generation 1 (%.1f s)", world, time.perf_counter() - t0)
        first_shard.call("start_agents", [0], True)  # node 0's election goes first: it leads
        assert first_shard.call("wait_leader", 0, 10.0, timeout=30.0), "node 0 was not elected"
        call_all(self.shards, "start_agents", None, standby_leaders, timeout=SETUP_TIMEOUT_S)
        wait_until("the leader's first round", lambda: self.leader_rounds() >= 1, 30.0, poll=0.05)
        out["setup_s"] = round(time.perf_counter() - t0, 2)
        _, threads = bench_usage(self.shards)
        out["threads"] = sum(threads)
        out["threads_per_proc"] = threads
        m = etcd_metrics(self.endpoint)
        out["watchers"] = int(m["etcd_debugging_mvcc_watcher_total"])
        out["watch_streams"] = int(m["etcd_debugging_mvcc_watch_stream_total"])
        return out

    def steady(self, *, steps: int, pace_ms: float) -> dict[str, Any]:
        """Part 1 (module doc): an idle second's background, then `steps` ticks every `pace_ms`
        ms; the per-step figures."""
        shards, endpoint, etcd_pid = self.shards, self.endpoint, self.server.pid
        time.sleep(0.5)
        idle0, cpu0 = etcd_metrics(endpoint), cpu_now(shards, etcd_pid)
        time.sleep(2.0)
        idle1, cpu1 = etcd_metrics(endpoint), cpu_now(shards, etcd_pid)
        background = counts(delta(idle1, idle0), per=2.0)
        call_all(shards, "run")
        before, cpu2 = etcd_metrics(endpoint), cpu_now(shards, etcd_pid)
        run_s = self._tick(steps, pace_ms)
        cpu3 = cpu_now(shards, etcd_pid)
        self._settle(steps - 1)
        after = etcd_metrics(endpoint)
        per_step = counts(delta(after, before), per=steps)
        parts = call_all(shards, "steady", timeout=120.0)
        seen_each, seen_all = trigger_latencies(parts, steps)
        job_keys = int(self.admin.get_prefix_response(self.keys.root, count_only=True).count)
        return {
            "ticks_s": round(run_s, 3),
            "requested_us": summary(concat(parts, "requested"), 1e6, 1),
            "latest_us": summary(concat(parts, "latest"), 1e6, 1),
            "publish_us": summary(concat(parts, "publish"), 1e6, 1),
            "coordination_us": summary(concat(parts, "per_step"), 1e6, 1),
            "agents_seen_all_ms": summary(seen_all, 1e3, 2),
            "agent_seen_each_ms": summary(seen_each, 1e3, 2),
            "per_step": per_step,
            "trigger_events_per_step": round(sum(p["trigger_events"] for p in parts) / steps, 2),
            "progress_puts": sum(p["progress_puts"] for p in parts),
            "background_per_s": background,
            "sim_lag_ms": summary(concat(parts, "lag"), 1e3, 2),
            "bench_cpu_idle": round((cpu1["bench"] - cpu0["bench"]) / 2.0, 2),
            "bench_cpu_steps": round((cpu3["bench"] - cpu2["bench"]) / run_s, 2),
            "cores_idle": cores(cpu1, cpu0, 2.0),
            "cores_steps": cores(cpu3, cpu2, run_s),
            "db_bytes": int(after["etcd_mvcc_db_total_size_in_bytes"]),
            "db_in_use_bytes": int(after["etcd_mvcc_db_total_size_in_use_in_bytes"]),
            "job_keys": job_keys,
        }

    def _tick(self, steps: int, pace_ms: float) -> float:
        """The step clock: tick every shard once per step, every `pace_ms` ms; the seconds it took."""
        start = time.perf_counter()
        for s in range(steps):
            time.sleep(max(0.0, start + (s + 1) * pace_ms / 1e3 - time.perf_counter()))
            at = time.time()  # the vote of step s completed: tell every shard's clock
            for sh in self.shards:
                sh.post("tick", s, at)
        return time.perf_counter() - start

    def _settle(self, last: int) -> None:
        """Wait until every driver and every trigger is at step `last`; RuntimeError if a
        generation was halted meanwhile (a lease expired?)."""

        def settled(what: str) -> bool:
            states = call_all(self.shards, "progress", last)
            halted = [n for st in states for n in st["halted"]]
            if halted:
                raise RuntimeError(f"a generation was halted during the failure-free steps (nodes "
                                   f"{halted[:8]}: a lease expired?)")
            return all(st[what] for st in states)

        wait_until("every driver at the last step", lambda: settled("done"), 60.0, poll=0.02)
        wait_until("every trigger at the last step", lambda: settled("triggers"), 60.0, poll=0.02)

    def change(self) -> dict[str, Any]:
        """Part 2 (module doc): one node stops and is reported failed; the figures of the
        generation change until every live worker has generation 2."""
        shards, endpoint, etcd_pid = self.shards, self.endpoint, self.server.pid
        rank0_node = self.plan.pipelines[0].stages[0].node
        victim = max(n for n in range(self.layout.n_nodes) if n not in (0, rank0_node))
        victim_shard = shards[self.layout.shard_of[victim]]
        observer = self.observer = Observer(self.admin, self.keys)
        victim_shard.call("kill", victim)
        rounds0 = self.leader_rounds()
        before, cpu4 = etcd_metrics(endpoint), cpu_now(shards, etcd_pid)
        t_fail, reported = victim_shard.call("report_failure", victim)
        assert reported, f"node {victim}'s member was not registered any more"
        self._await_generation_2(observer)
        t_seen = time.time()
        call_all(shards, "enter", 2, timeout=SETUP_TIMEOUT_S)  # the survivors' recovery records of g+1 (first commit)
        t_done = time.time()
        cpu5 = cpu_now(shards, etcd_pid)
        time.sleep(1.0)  # the leader's round after the publish, late watch deliveries
        after = etcd_metrics(endpoint)
        parts = call_all(shards, "change", 2)
        record = GenerationRecord.from_json(parts[0]["record"])  # node 0's shard: never the victim's only
        halt_at = observer.at(self.rk.halt(1))
        plan_at = observer.at(self.keys.plan(2))
        assert halt_at is not None and plan_at is not None
        aborts = concat(parts, "aborts")
        synced = concat(parts, "synced")
        seen = concat(parts, "seen")
        return {
            "lost_node": victim,
            "lost_in_record": record.lost,
            "valid": record.lost == [victim] and max(p["latest"] for p in parts) == 2,
            "latest_generation": max(p["latest"] for p in parts),
            "leases_lost": concat(parts, "leases_lost"),
            "new_plan": {
                "pipelines": len(record.plan.pipelines),
                "stages_per_pipeline": sorted({len(p.stages) for p in record.plan.pipelines}),
                "reason": record.reason[:120],
            },
            "detected_s": round((record.detected_at or t_fail) - t_fail, 4),
            "halt_written_s": round(halt_at - t_fail, 4),
            "halt_seen_all_s": round(max(aborts) - t_fail, 4),
            "syncs_written_s": round(max(synced) - t_fail, 4),
            "published_s": round(plan_at - t_fail, 4),
            "leader_published_at_s": round((record.published_at or t_fail) - t_fail, 4),
            "all_seen_s": round(max(seen) - t_fail, 4),
            "seen_p50_s": round(pct(seen, 50) - t_fail, 4),
            "measured_until_s": round(t_done - t_fail, 4),
            "entered_s": round(t_done - t_seen, 4),
            "all_seen_by_proc_s": [round(max(p["seen"]) - t_fail, 4) for p in parts if p["seen"]],
            "cores": cores(cpu5, cpu4, max(t_done - t_fail, 1e-3)),
            "leader_rounds": self.leader_rounds() - rounds0,
            "etcd": counts(delta(after, before)),
            "writes_by_family": observer.writes_by_family(),
        }

    def _await_generation_2(self, observer: Observer) -> None:
        """Wait until every live worker has generation 2 and wrote its sync report, and the
        observer saw `plan/2`."""

        def changed(what: str) -> bool:
            return all(st[what] for st in call_all(self.shards, "change_status", 2))

        wait_until("generation 2 on every live worker", lambda: changed("seen"), 120.0, poll=0.02)
        wait_until("every live worker's sync report", lambda: changed("synced"), 30.0, poll=0.02)
        wait_until("the observer", lambda: observer.at(self.keys.plan(2)) is not None, 30.0)

    def close(self, *, interrupted: bool) -> float:
        """End the observer, every shard and the bench's client; the seconds it took."""
        t0 = time.perf_counter()
        if self.observer is not None:
            self.observer.close()
        # Stage by stage on every shard, then each process joined or killed; a Ctrl-C also
        # reaches etcd (same process group), so only "abort" when interrupted or etcd is gone.
        teardown(self.shards, graceful=not interrupted and self.server.running())
        with contextlib.suppress(Exception):
            self.admin.close()
        return round(time.perf_counter() - t0, 2)


def trigger_latencies(parts: list[dict[str, Any]], steps: int) -> tuple[list[float], list[float]]:
    """Seconds from rank 0's publish of each step until each agent's trigger had it (every
    agent, every step), and until the last one had it (one per step)."""
    publish_at: dict[int, float] = {}
    for p in parts:
        publish_at.update(p["publish_at"])
    seen_by_trigger: list[dict[int, float]] = [d for p in parts for d in p["seen"]]
    seen_each: list[float] = []
    seen_all: list[float] = []
    for s in range(steps):
        published = publish_at[s]
        lat = [seen[s] - published for seen in seen_by_trigger]
        seen_each.extend(lat)
        seen_all.append(max(lat))
    return seen_each, seen_all


def run_one(
    world: int,
    *,
    steps: int = 100,
    pace_ms: float = 20.0,
    rendezvous: bool = True,
    standby_leaders: bool = True,
    procs: int | None = None,
    grpc_poll_s: float = GRPC_POLL_S,
    relay: bool = True,
    switch_interval_ms: float = SWITCH_INTERVAL_MS,
) -> dict[str, Any]:
    """Everything for one W (see the module doc); JSON-serialisable. `procs`: shard processes
    (None: `default_procs(world)`; 0: one shard, a thread of this process)."""
    wall0 = time.perf_counter()
    layout = ShardLayout.of(world, procs)
    out: dict[str, Any] = {"workers": world, "nodes": layout.n_nodes, "gpus_per_node": layout.gpus, "model": MODEL,
                           "etcd_clients": layout.n_nodes + 1, "steps": steps, "pace_ms": pace_ms,
                           "switch_interval_ms": switch_interval_ms,
                           "standby_leaders": standby_leaders, "relay": relay,
                           "procs": 0 if layout.in_process else layout.n_shards,
                           "nodes_per_proc": [len(b) for b in layout.blocks]}
    with tempfile.TemporaryDirectory(prefix="cp-scale-") as run_dir, EtcdServer() as server:
        run = ScaleRun(layout, server=server, run_dir=run_dir, grpc_poll_s=grpc_poll_s, relay=relay,
                       switch_interval_ms=switch_interval_ms)
        out["plan"] = run.plan_figures()
        run.admin.put(run.rk.config, run.config.to_packed())
        interrupted = False
        try:
            out.update(run.setup(standby_leaders=standby_leaders))
            out["steady"] = run.steady(steps=steps, pace_ms=pace_ms)
            out["change"] = run.change()
            # -- 3. the new generation's rendezvous --------------------------------------------
            out["rendezvous"] = rendezvous_figure(server.endpoint, world) if rendezvous else {"status": "skipped"}
            final = etcd_metrics(server.endpoint)
            out["db_bytes_end"] = int(final["etcd_mvcc_db_total_size_in_bytes"])
        except BaseException as exc:
            interrupted = not isinstance(exc, Exception)  # Ctrl-C, SIGTERM: end the shards at once
            raise
        finally:
            out["teardown_s"] = run.close(interrupted=interrupted)
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
    procs: int | None = None,
    relay: bool = True,
    switch_interval_ms: float = SWITCH_INTERVAL_MS,
) -> list[dict]:
    """One dict per W in `worlds` (see `run_one`); `procs` as there, for every W."""
    set_grpc_poll(grpc_poll_s)  # this process: the observer's and the rendezvous figure's streams
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
                    procs=procs,
                    grpc_poll_s=grpc_poll_s,
                    relay=relay,
                    switch_interval_ms=switch_interval_ms,
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
    ("procs", lambda r: r["procs"]),
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
    ("/node", lambda r: round(r["change"]["etcd"]["writes"] / r["nodes"], 2)),
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
                    help="idle wake-up period of gRPC stream threads (grpc's default: 0.1)")
    ap.add_argument("--switch-interval-ms", type=float, default=SWITCH_INTERVAL_MS,
                    help="CPython's forced GIL switch period in every shard (CPython's default: 5)")
    ap.add_argument("--no-standby-leaders", action="store_true",
                    help="only the elected agent runs a Leader (the real agents all do; shows their watch fan-out)")
    ap.add_argument("--procs", type=int, default=None,
                    help="shard processes hosting the nodes (default: 1 for W <= 64, else at most "
                         f"{NODES_PER_PROC} nodes / {WORKERS_PER_PROC} workers a process; 0: the nodes "
                         "run in this process, as threads)")
    ap.add_argument("--no-relay", action="store_true",
                    help="each worker puts its reports and watches plan/halt/decisions itself, not through its agent's relay (the runtime before issue 34)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("-v", "--verbose", action="store_true", help="the runtime's warnings (halts, publishes)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.verbose else logging.ERROR,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.setLevel(logging.INFO)
    exit_on_sigterm()  # SIGTERM runs the `finally`s: shards torn down and joined, etcd stopped
    t0 = time.perf_counter()
    results = run_scale(args.workers, steps=args.steps, pace_ms=args.pace_ms, rendezvous=not args.no_rendezvous,
                        grpc_poll_s=args.grpc_poll_s, standby_leaders=not args.no_standby_leaders,
                        procs=args.procs, relay=not args.no_relay, switch_interval_ms=args.switch_interval_ms)
    total = time.perf_counter() - t0
    print(table(results))
    print(f"total wall time {total:.1f} s; etcd clients = nodes + 1 (one per node, shared by its agent "
          f"and its workers); coord = HaltFeed.requested + GenerationFeed.latest (+ rank 0's publish) per "
          f"worker-step; procs = shard processes hosting the nodes (0: in this process)")
    if args.json is not None:
        args.json.write_text(json.dumps({"results": results, "wall_s": round(total, 2)}, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
