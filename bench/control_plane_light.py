"""Issue 34 part 2: the control plane of 16,384 workers (2,048 nodes x 8) against one real etcd.

    .venv/bin/python bench/control_plane_light.py [--nodes 2048] [--steps 1000] [--changes 10] [--runs 3] [--json out.json]

Each run: a fresh etcd (`EtcdServer`, 127.0.0.1), the job of bench/control_plane_scale.py at
W = 8 x nodes (gpt3-6.7b planned on 128 GiB nodes: pipelines of 2 nodes, f = 1), and its nodes
spread over shard processes (`--procs`, default 128 nodes each) as light nodes
(bench/control_plane_light_shard.py: every etcd request of a node's agent, relay and workers is
made, by the runtime's own classes, and node 0's real Leader leads; what a worker does locally
is not run, and the decode of a generation record by a node's workers is timed once a shard and
charged to every node). Then `--steps` simulated steps (a tick every `--pace-ms` ms; world
rank 0's real `ProgressWriter` puts `progress`; `--waiting` nodes have an injection waiting on a
step, so their agent watches `progress`) in `--changes` + 1 segments, with a generation change
between two segments: one node's member is reported failed (the worker monitor's path), the
leader halts generation g, every live node's workers report, the leader publishes g+1, every
node's workers have it, and enter it (their recovery records).

Per change: seconds from the failure report to the halt written, the halt seen by every live
node, every sync report written, g+1 published, g+1 at every node (its watch), every worker has
g+1 (that plus the decode), every recovery record written; etcd writes (revisions), watch events
and ranges in the change (etcd's /metrics), the writes by the key families each revision touched.
Per step (the first segment): etcd writes, puts and ranges, watch events per progress put.
At the end: etcd's db size and the job's keys. The figures of `--runs` runs and their medians.

What this machine cannot show: real nodes do their work in parallel on their own hosts, here
2,048 nodes share 2 cores (and etcd with them), so every figure of a change includes the
simulation's own queueing; the group rendezvous of g+1 is not run (see bench/rendezvous_scale.py:
its W ranks are threads of one process).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.control_plane_scale import (  # noqa: E402
    GRPC_POLL_S,
    SETUP_TIMEOUT_S,
    SWITCH_INTERVAL_MS,
    Observer,
    bench_usage,
    by_family,
    concat,
    cores,
    counts,
    cpu_now,
    delta,
    etcd_metrics,
    family,
    make_config,
    pct,
    split_nodes,
    summary,
    wait_until,
)
from bench.control_plane_shard import THREAD_STACK, ShardHandle, ShardSpec, call_all, set_grpc_poll, teardown  # noqa: E402
from bench.section import exit_on_sigterm  # noqa: E402
from elastic.coordinator import EtcdConfig, EtcdServer, JobKeys, connect  # noqa: E402
from elastic.coordinator.generations import Generations  # noqa: E402
from elastic.coordinator.keys import RunKeys  # noqa: E402
from elastic.records.generation import GenerationRecord  # noqa: E402

log = logging.getLogger("control_plane_light")

GPUS = 8
NODES_PER_PROC = 128
LEASE_TTL = 600
"""Lease TTL (s) of the light nodes' members and elections. The loss under test is reported (the
worker monitor's path), so the TTL enters no figure. A shard process holds 128 nodes' ~1,200
threads; in a change most of them want the GIL at once, and a lease's keep-alive thread (wake,
send, read the answer: three GIL hand-offs) was starved past a 60 s TTL: 3-200 leases a run
expired that way (2026-11-29). A real agent's process has a few threads."""


def blocks_of(nodes: int, procs: int) -> list[tuple[int, ...]]:
    """Node 0 (the leader) in a process of its own, as on a host of its own; the other nodes in
    `procs` - 1 contiguous blocks."""
    rest = split_nodes(nodes - 1, max(1, procs - 1))
    return [(0,)] + [tuple(n + 1 for n in block) for block in rest]


SCAN_PAGE = 5000
"""Keys a page of `scan` reads (etcd's answers must stay under gRPC's 4 MiB)."""


def scan(client: Any, prefix: str, *, keys_only: bool) -> list[Any]:
    """Every key-value under `prefix`, read a page at a time."""
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    out: list[Any] = []
    start = prefix
    while True:
        kvs = list(client.get_range_response(start, end, keys_only=keys_only, limit=SCAN_PAGE).kvs)
        out.extend(kvs)
        if len(kvs) < SCAN_PAGE:
            return out
        start = kvs[-1].key.decode() + "\0"


class LightRun:
    """One run: etcd, the shards, the job; its phases."""

    def __init__(self, *, nodes: int, procs: int, nodes_per_client: int, waiting: int, server: EtcdServer,
                 run_dir: str) -> None:
        self.server, self.endpoint = server, server.endpoint
        self.n_nodes, self.world = nodes, nodes * GPUS
        self.blocks = blocks_of(nodes, procs)
        self.shard_of = {n: i for i, b in enumerate(self.blocks) for n in b}
        self.nodes_per_client = nodes_per_client
        self.admin = connect(EtcdConfig(endpoint=self.endpoint))
        self.keys = JobKeys(f"light-{self.world}")
        self.rk = RunKeys(self.keys)
        config, self.plan = make_config(self.world, run_dir)
        self.config = dataclasses.replace(config, lease_ttl=LEASE_TTL)
        self.rank0 = self.plan.pipelines[0].stages[0].node
        self.waiting = [int(i * nodes / waiting) for i in range(waiting)] if waiting else []
        self.live = set(range(nodes))
        self.shards: list[ShardHandle] = []
        self.observer: Observer | None = None
        self.generation = 0
        self.step = 0
        self.progress_puts = 0
        """Progress puts of world rank 0's writer so far (each segment's figures are the difference)."""

    def setup(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.admin.put(self.rk.config, self.config.to_packed())
        level = logging.getLogger().getEffectiveLevel()
        for i, block in enumerate(self.blocks):
            spec = ShardSpec(index=i, endpoint=self.endpoint, job=self.keys.job, config_json=self.config.to_json(),
                             nodes=block, gpus=GPUS, grpc_poll_s=GRPC_POLL_S,
                             switch_interval_s=SWITCH_INTERVAL_MS / 1000, log_level=level, light=True,
                             nodes_per_client=self.nodes_per_client)
            self.shards.append(ShardHandle(spec))
        made = call_all(self.shards, "setup", timeout=SETUP_TIMEOUT_S)
        log.info("%d members joined (%.1f s)", self.n_nodes, time.perf_counter() - t0)
        first = GenerationRecord(plan=self.plan, resume_step=0, incarnations=dict.fromkeys(range(self.n_nodes), 0))
        Generations(self.admin, self.keys).publish(first.to_json(), expected=0)
        lead = self.shards[self.shard_of[0]]
        lead.call("start_agents", [0], 0, self.waiting)
        assert lead.call("wait_leader", 0, 10.0, timeout=30.0), "node 0 was not elected"
        call_all(self.shards, "start_agents", None, 0, self.waiting, timeout=SETUP_TIMEOUT_S)
        log.info("agents up (%.1f s)", time.perf_counter() - t0)
        wait_until("generation 1 at every node", lambda: self._all("change_status", 1, key="seen"), 120.0, poll=0.1)
        call_all(self.shards, "enter", 1, timeout=SETUP_TIMEOUT_S)
        self.generation = 1
        self.shards[self.shard_of[self.rank0]].call("rank0", self.rank0)
        wait_until("the leader's first round", lambda: lead.call("leader_rounds", 0) >= 1, 30.0, poll=0.05)
        _, threads = bench_usage(self.shards)
        m = etcd_metrics(self.endpoint)
        # halt/ and plan/ arrivals; `progress` as the launcher watches it (every step)
        self.observer = Observer(self.admin, self.keys, families=False, also=(self.rk.progress,))
        return {"setup_s": round(time.perf_counter() - t0, 1), "threads": sum(threads),
                "etcd_clients": sum(s["clients"] for s in made) + 1,
                "watchers": int(m["etcd_debugging_mvcc_watcher_total"]),
                "watch_streams": int(m["etcd_debugging_mvcc_watch_stream_total"]), **db_mb(m)}

    def _all(self, command: str, *args: Any, key: str) -> bool:
        return all(st[key] for st in call_all(self.shards, command, *args))

    def steps(self, n: int, pace_ms: float) -> dict[str, Any]:
        """`n` ticks to world rank 0's shard; the per-step figures."""
        rank0 = self.shards[self.shard_of[self.rank0]]
        before, cpu0 = etcd_metrics(self.endpoint), cpu_now(self.shards, self.server.pid)
        t0 = time.perf_counter()
        first = self.step
        for i in range(n):
            time.sleep(max(0.0, t0 + i * pace_ms / 1000 - time.perf_counter()))
            rank0.post("tick", self.step, time.time())
            self.step += 1
        run_s = time.perf_counter() - t0
        cpu1 = cpu_now(self.shards, self.server.pid)
        last = self.step - 1
        wait_until("every waiting trigger at the last step", lambda: all(call_all(self.shards, "triggers", last)),
                   60.0, poll=0.02)
        time.sleep(0.6)  # the writer's last coalesced put
        after = etcd_metrics(self.endpoint)
        call_all(self.shards, "set_committed", self.step)
        parts = call_all(self.shards, "steady")
        publish_at = {int(k): v for p in parts for k, v in p["publish_at"].items()}
        seen = [d for p in parts for d in p["seen"]]
        lat = [max(s[st] for s in seen) - publish_at[st] for st in range(first, self.step) if seen]
        per = delta(after, before)
        total_puts = sum(p["progress_puts"] for p in parts)
        puts, self.progress_puts = max(1, total_puts - self.progress_puts), total_puts
        return {"steps": n, "ticks_s": round(run_s, 2), "per_step": counts(per, per=n), "progress_puts": puts,
                "waiting_nodes": sum(p["waiting"] for p in parts),
                "events_per_put": round(per["etcd_debugging_mvcc_events_total"] / puts, 2),
                "publish_us": summary(concat(parts, "publish_s")[-n:], 1e6, 1),
                "waiting_seen_all_ms": summary(lat, 1e3, 1),
                "cores": cores(cpu1, cpu0, max(run_s, 1e-3))}

    def change(self) -> dict[str, Any]:
        """One node lost; the figures of the change from generation g to g+1."""
        g = self.generation
        victim = max(self.live - {0, self.rank0})
        shard = self.shards[self.shard_of[victim]]
        shard.call("kill", victim)
        self.live.discard(victim)
        assert self.observer is not None
        rev0 = int(self.admin.get_prefix_response(self.keys.root, count_only=True).header.revision)
        before, cpu0 = etcd_metrics(self.endpoint), cpu_now(self.shards, self.server.pid)
        t_fail, reported = shard.call("report_failure", victim)
        assert reported, f"node {victim}'s member was not registered any more"
        wait_until(f"generation {g + 1} at every live node", lambda: self._all("change_status", g + 1, key="seen"),
                   120.0, poll=0.02)
        wait_until("every live node's sync report", lambda: self._all("change_status", g + 1, key="synced"),
                   60.0, poll=0.02)
        t_seen = time.time()
        call_all(self.shards, "enter", g + 1, timeout=SETUP_TIMEOUT_S)
        t_done = time.time()
        cpu1 = cpu_now(self.shards, self.server.pid)
        self.generation = g + 1
        wait_until("the observer", lambda: self.observer.at(self.keys.plan(g + 1)) is not None, 30.0)  # type: ignore[union-attr]
        time.sleep(0.5)  # late watch deliveries
        after = etcd_metrics(self.endpoint)
        parts = call_all(self.shards, "change", g + 1)
        record = GenerationRecord.from_json(parts[self.shard_of[0]]["record"])
        halt_at, plan_at = self.observer.at(self.rk.halt(g)), self.observer.at(self.keys.plan(g + 1))
        assert halt_at is not None and plan_at is not None
        seen = concat(parts, "seen")
        writes = counts(delta(after, before))
        return {
            "generation": g + 1, "lost_node": victim, "valid": record.lost == [victim],
            "live_nodes": len(self.live),
            "halt_written_s": round(halt_at - t_fail, 3),
            # the leader's own clock: loss seen, every sync report read, the record published
            "leader_detected_s": round((record.detected_at or t_fail) - t_fail, 3),
            "leader_synced_s": round((record.synced_at or t_fail) - t_fail, 3),
            "leader_published_s": round((record.published_at or t_fail) - t_fail, 3),
            "halt_seen_all_s": round(max(concat(parts, "aborts")) - t_fail, 3),
            "syncs_written_s": round(max(concat(parts, "synced")) - t_fail, 3),
            "published_s": round(plan_at - t_fail, 3),
            "arrived_all_s": round(max(concat(parts, "arrived")) - t_fail, 3),
            "all_seen_s": round(max(seen) - t_fail, 3),
            "seen_p50_s": round(pct(seen, 50) - t_fail, 3),
            "entered_all_s": round(max(concat(parts, "entered")) - t_fail, 3),
            "entered_after_seen_s": round(t_done - t_seen, 3),
            "decode_ms": round(1e3 * max(p["decode_s"] for p in parts), 2),
            "record_bytes": len(parts[self.shard_of[0]]["record"]),
            "etcd": writes, "writes_per_node": round(writes["writes"] / len(self.live), 3),
            "writes_by_family": self._families(rev0),
            "cores": cores(cpu1, cpu0, max(t_done - t_fail, 1e-3)),
            "cpu_s": {k: round(cpu1[k] - cpu0[k], 2) for k in cpu1},
            "leases_lost": concat(parts, "leases_lost"),
            **db_mb(after),  # where the db's high-water mark grows: after setup, or change by change
        }

    def _families(self, rev0: int) -> dict[str, int]:
        """etcd writes (revisions) after `rev0` by the key families they wrote, from the keys
        there now (one keys-only read after the change: a watch of the whole job would cost the
        bench as much CPU as a thousand nodes; deletions are counted by etcd's metrics)."""
        written: dict[int, set[str]] = {}
        for kv in scan(self.admin, self.keys.root, keys_only=True):
            if kv.mod_revision > rev0:
                written.setdefault(kv.mod_revision, set()).add(family(self.keys.root, kv.key.decode()))
        return by_family(written.values())

    def end(self) -> dict[str, Any]:
        """etcd's db size and the job's keys, with their bytes by family."""
        m = etcd_metrics(self.endpoint)
        kvs = scan(self.admin, self.keys.root, keys_only=False)
        fams: dict[str, list[int]] = {}
        for kv in kvs:
            f = fams.setdefault(family(self.keys.root, kv.key.decode()), [0, 0])
            f[0] += 1
            f[1] += len(kv.key) + len(kv.value)
        return {"db_bytes": int(m["etcd_mvcc_db_total_size_in_bytes"]),
                "db_in_use_bytes": int(m["etcd_mvcc_db_total_size_in_use_in_bytes"]),
                "job_keys": len(kvs),
                "keys_by_family": {k: {"keys": v[0], "bytes": v[1]} for k, v in sorted(fams.items())}}

    def close(self, *, interrupted: bool) -> None:
        if self.observer is not None:
            self.observer.close()
        teardown(self.shards, graceful=not interrupted and self.server.running(), timeout=180.0)
        self.admin.close()


def db_mb(m: dict[str, float]) -> dict[str, float]:
    """etcd's db size (its pages' high-water mark) and the part of it in use, in MB, from its metrics."""
    return {"db_mb": round(m["etcd_mvcc_db_total_size_in_bytes"] / 2**20, 2),
            "db_in_use_mb": round(m["etcd_mvcc_db_total_size_in_use_in_bytes"] / 2**20, 2)}


def run_one(*, nodes: int, steps: int, changes: int, pace_ms: float, procs: int, nodes_per_client: int,
            waiting: int) -> dict[str, Any]:
    wall0 = time.perf_counter()
    out: dict[str, Any] = {"nodes": nodes, "workers": nodes * GPUS, "procs": procs, "steps": steps,
                           "changes": changes, "pace_ms": pace_ms, "nodes_per_client": nodes_per_client}
    segment = steps // (changes + 1)
    with tempfile.TemporaryDirectory(prefix="cp-light-") as run_dir, EtcdServer() as server:
        run = LightRun(nodes=nodes, procs=procs, nodes_per_client=nodes_per_client, waiting=waiting, server=server,
                       run_dir=run_dir)
        out["plan"] = {"pipelines": len(run.plan.pipelines), "json_bytes": len(run.plan.to_json())}
        interrupted = False
        try:
            out["setup"] = run.setup()
            log.info("setup: %s", out["setup"])
            out["steady"] = run.steps(segment, pace_ms)
            log.info("steady: %s", json.dumps(out["steady"])[:300])
            out["changes_detail"] = []
            for i in range(changes):
                out["changes_detail"].append(run.change())
                log.info("change %d: %s", i + 1, json.dumps(out["changes_detail"][-1]))
                run.steps(segment if i < changes - 1 else steps - segment * (changes), pace_ms)
            out["end"] = run.end()
        except BaseException as exc:
            interrupted = not isinstance(exc, Exception)
            raise
        finally:
            run.close(interrupted=interrupted)
    out["wall_s"] = round(time.perf_counter() - wall0, 1)
    return out


CHANGE_FIGURES = ("halt_written_s", "halt_seen_all_s", "syncs_written_s", "published_s", "arrived_all_s",
                  "all_seen_s", "entered_all_s", "writes_per_node")


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure: the median over every change of every run, and the median of each run's medians."""
    ok = [r for r in runs if "error" not in r]
    out: dict[str, Any] = {}
    for name in CHANGE_FIGURES:
        per_run = [statistics.median(c[name] for c in r["changes_detail"]) for r in ok if r["changes_detail"]]
        out[name] = {"median_of_runs": round(statistics.median(per_run), 3) if per_run else None,
                     "runs": [round(v, 3) for v in per_run],
                     "max": max((c[name] for r in ok for c in r["changes_detail"]), default=None)}
    for name, get in (("events_per_put", lambda r: r["steady"]["events_per_put"]),
                      ("db_mb", lambda r: r["end"]["db_bytes"] / 2**20),
                      ("setup_s", lambda r: r["setup"]["setup_s"])):
        vals = [get(r) for r in ok]
        out[name] = {"median_of_runs": round(statistics.median(vals), 3) if vals else None,
                     "runs": [round(v, 3) for v in vals]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--nodes", type=int, default=2048, help="simulated nodes (8 workers each)")
    ap.add_argument("--steps", type=int, default=1000, help="simulated steps in all")
    ap.add_argument("--changes", type=int, default=10, help="generation changes, one lost node each")
    ap.add_argument("--pace-ms", type=float, default=20.0, help="one simulated step every this many ms")
    ap.add_argument("--procs", type=int, default=None, help=f"shard processes (default: node 0 alone, then {NODES_PER_PROC} nodes each)")
    ap.add_argument("--nodes-per-client", type=int, default=1, help="nodes sharing an etcd client (1: as real agents)")
    ap.add_argument("--waiting", type=int, default=4, help="nodes whose agent has an injection waiting on a step")
    ap.add_argument("--runs", type=int, default=1, help="fresh runs (the table gives their medians)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.verbose else logging.ERROR,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.setLevel(logging.INFO)
    exit_on_sigterm()
    set_grpc_poll(GRPC_POLL_S)
    threading.stack_size(THREAD_STACK)
    procs = args.procs or 1 + math.ceil((args.nodes - 1) / NODES_PER_PROC)
    runs: list[dict[str, Any]] = []
    for i in range(args.runs):
        log.info("run %d of %d: %d nodes, %d shard processes", i + 1, args.runs, args.nodes, procs)
        try:
            runs.append(run_one(nodes=args.nodes, steps=args.steps, changes=args.changes, pace_ms=args.pace_ms,
                                procs=procs, nodes_per_client=args.nodes_per_client, waiting=args.waiting))
        except Exception as exc:
            log.exception("run %d failed", i + 1)
            runs.append({"error": f"{type(exc).__name__}: {exc}"})
        if args.json is not None:
            args.json.write_text(json.dumps({"runs": runs, "medians": medians(runs)}, indent=1))
    print(json.dumps(medians(runs), indent=1))
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
