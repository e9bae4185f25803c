"""A Prometheus endpoint per node, fed from etcd: what the job did, as this node's agent sees it.

The agent starts one `NodeMetrics` (one call, after it joined the membership):

    NodeMetrics(client, keys, node=node, lease=membership.lease_id).start()

It mirrors the job's `progress` and `eval` keys and six prefixes (`plan/`, `recoveries/`, `workers/<node>/`,
`members/`, `injected/`, `checkpoint-failures/`), each read once and then kept current by a watch from the revision after
that read (never from revision 1: auto-compaction drops old history), serves them in its own `CollectorRegistry` on
`host:port` (default `elastic.coordinator.netaddr.bind_host()`, port `$ELASTIC_METRICS_PORT` or a free
one) and publishes `metrics/<node_id>` = {"address": "host:port"} on the node's lease, so the key
goes when the node does (`metrics_addresses` reads them all back, for `elastic status`).

Every value is computed from the mirrored etcd state at scrape time; nothing is counted locally,
so a metrics server started late (or restarted) reports the same numbers:

| name | type | labels | meaning |
| --- | --- | --- | --- |
| elastic_node_info | info | job_id, node | which job and node this endpoint belongs to (value 1) |
| elastic_step | gauge | | steps committed (index of the last committed step + 1) |
| elastic_loss | gauge | | loss of the last committed step |
| elastic_eval_loss | gauge | | the latest validation loss on the held-out split (`--eval-every`; absent before the first) |
| elastic_eval_step | gauge | | steps committed when that validation loss was computed |
| elastic_step_seconds | gauge | | wall time of the last committed step on its reporting worker |
| elastic_tokens_per_second | gauge | | tokens of the last `window` committed steps (at most the progress record's 8) over the wall time they spanned |
| elastic_generation | gauge | | the latest published generation |
| elastic_recoveries_total | counter | | reconfigurations: generations published after the first |
| elastic_last_recovery_seconds | gauge | | the latest finished recovery, injected fault (or detection) to first commit |
| elastic_last_recovery_phase_seconds | gauge | phase | that recovery's detecting, planning, transferring, rebuilding, replaying seconds |
| elastic_recovery_seconds | histogram | | every finished recovery's total seconds |
| elastic_transfer_bytes_total | counter | | shard bytes fetched by this node's workers, all reconfigurations |
| elastic_job_transfer_bytes_total | counter | | shard bytes fetched by every worker of the job |
| elastic_workers | gauge | | workers this node registered (their keys live on the node's lease) |
| elastic_workers_alive | gauge | | of those, processes that exist here and are neither stopped nor zombies |
| elastic_nodes_alive | gauge | | members of the job with a live lease |
| elastic_checkpoint_save_failures_total | counter | | checkpoint saves of the job that failed (a full or failing disk), each counted once |
| elastic_spares | gauge | | of those, hot spares: live members the latest generation does not include (elastic/planning/spares.py) |
| elastic_node_spare | gauge | | 1 while this endpoint's node is a hot spare, else 0 |
| elastic_node_busy_seconds | gauge | | this node's compute seconds a step, forward plus backward (median of the last 5; the `stragglers` key, read at scrape time) |
| elastic_node_forward_seconds | gauge | | of those, its forward passes' (median of the last 5; elastic/parallel/phase_clock.py) |
| elastic_node_backward_seconds | gauge | | of those, its backward passes' (median of the last 5) |
| elastic_node_wait_seconds | gauge | | its seconds a step blocked on pipeline peers (median of the last 5) |
| elastic_node_speed_factor | gauge | | those seconds per unit of work over its peers' median (elastic/planning/stragglers.py) |
| elastic_node_straggler | gauge | | 1 while this node is marked as a straggler, else 0 |

A recovery's breakdown follows elastic.roles.progress (the run summary's recovery entries),
so the gauges agree with `summary.json`; a recovery counts as finished once every worker of its
generation reported its timings, or a later generation superseded it after some did.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import psutil
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.coordinator.membership import NodeIdentity
from elastic.coordinator.netaddr import bind_host
from elastic.coordinator.watch import WatchEvent, watch_from_now
from elastic.parallel.layout import assign_ranks
from elastic.parallel.phase_clock import STEP_PHASES
from elastic.records.checkpoint_failures import SaveFailures, save_failures_prefix
from elastic.records.evals import EvalResult, eval_key
from elastic.records.generation import GenerationRecord
from elastic.records.job import shape_of_spec
from elastic.records.progress import ProgressRecord
from elastic.records.recoveries import breakdown_of
from elastic.records.recovery_timings import RecoveryTimings
from elastic.records.stragglers import read_stragglers
from elastic.records.workers import WorkerInfo, node_id, node_of

log = logging.getLogger(__name__)

PORT_ENV = "ELASTIC_METRICS_PORT"
PHASES = ("detecting", "planning", "transferring", "rebuilding", "replaying")
BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
"""Upper bounds (seconds) of the recovery histogram's buckets (+Inf is added)."""


def metrics_key(keys: JobKeys, node: int) -> str:
    """`metrics/<node_id>`: where plan node `node` publishes its metrics address."""
    return keys.key("metrics", node_id(node))


def metrics_addresses(client: EtcdClient, keys: JobKeys) -> dict[str, str]:
    """node id -> `host:port` of every metrics endpoint published in the job."""
    prefix = keys.prefix("metrics")
    found: dict[str, str] = {}
    for value, meta in client.get_prefix(prefix):
        try:
            found[meta.key.decode()[len(prefix) :]] = str(json.loads(value)["address"])
        except (ValueError, TypeError, KeyError):
            log.warning("metrics: ignoring malformed %s", meta.key.decode())
    return found


def spare_members(members: dict[str, Any], plans: dict[str, GenerationRecord]) -> set[int]:
    """Nodes of the live `members` (raw member records) whose incarnation the latest of `plans`
    does not include: the hot spares (none before generation 1)."""
    if not plans:
        return set()
    latest = plans[max(plans, key=int)]
    out = set()
    for raw in members.values():
        try:
            ident = NodeIdentity.from_json(raw)
            node = node_of(ident.node_id)
        except (ValueError, TypeError, KeyError):
            continue
        if latest.incarnations.get(node) != ident.incarnation:
            out.add(node)
    return out


class _Mirror:
    """A local copy of the keys under one prefix, parsed: read once, then kept current by a watch
    from the revision after that read."""

    def __init__(self, client: EtcdClient, prefix: str, parse: Callable[[bytes], Any]) -> None:
        self.prefix = prefix
        self._parse = parse
        self._lock = threading.Lock()
        self._items: dict[str, Any] = {}
        self._watch = watch_from_now(client, prefix, self._on_events)

    def _on_events(self, events: list[WatchEvent]) -> None:
        with self._lock:
            for ev in events:
                name = ev.key[len(self.prefix) :]
                if ev.kind == "delete":
                    self._items.pop(name, None)
                    continue
                try:
                    self._items[name] = self._parse(ev.value)
                except (ValueError, TypeError, KeyError) as exc:
                    log.warning("metrics: skipping malformed %s%s: %s", self.prefix, name, exc)

    def items(self) -> dict[str, Any]:
        """key (relative to the prefix) -> parsed value, a copy."""
        with self._lock:
            return dict(self._items)

    def wait_ready(self, timeout: float) -> bool:
        return self._watch.wait_ready(timeout)

    def close(self) -> None:
        self._watch.cancel()


@dataclass(frozen=True, kw_only=True)
class Recovery:
    """A finished recovery as the metrics see it (the fields of the summary's recovery entry)."""

    generation: int
    """Generation it recovered into."""
    total_s: float
    """Fault (or detection) to the first commit."""
    phases: dict[str, float]
    """Seconds per phase, keys PHASES."""


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """Every value the endpoint serves, computed from the mirrored etcd state (names: module doc)."""

    step: int = 0
    """elastic_step."""
    loss: float | None = None
    """elastic_loss (None: no step committed yet)."""
    step_seconds: float | None = None
    """elastic_step_seconds."""
    tokens_per_s: float | None = None
    """elastic_tokens_per_second (None: no step yet, or the job config not read)."""
    generation: int = 0
    """elastic_generation."""
    recoveries: int = 0
    """elastic_recoveries_total."""
    finished: list[Recovery] = field(default_factory=list)
    """Finished recoveries by generation: the last one's gauges and the histogram."""
    node_bytes: int = 0
    """elastic_transfer_bytes_total."""
    job_bytes: int = 0
    """elastic_job_transfer_bytes_total."""
    workers: int = 0
    """elastic_workers."""
    workers_alive: int = 0
    """elastic_workers_alive."""
    nodes_alive: int = 0
    """elastic_nodes_alive."""
    eval_loss: float | None = None
    """elastic_eval_loss (None: no evaluation yet)."""
    eval_step: int | None = None
    """elastic_eval_step."""
    checkpoint_save_failures: int = 0
    """elastic_checkpoint_save_failures_total."""
    spares: int = 0
    """elastic_spares."""
    node_spare: bool = False
    """elastic_node_spare."""


def recovery_of(
    g: int, rec: GenerationRecord, timings: list[RecoveryTimings], injected: dict[str, float]
) -> Recovery:
    """The breakdown of elastic.roles.progress (the launcher's and `elastic status`'s), from
    mirrored values."""
    b = breakdown_of(g, rec, timings, list(injected.items()))
    return Recovery(generation=g, total_s=b["total_s"], phases={p: b[f"{p}_s"] for p in PHASES})


def _alive(pid: int) -> bool:
    try:
        status = psutil.Process(pid).status()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return status not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def snapshot(
    *,
    node: int,
    seq_len: int | None,
    window: int,
    plans: dict[int, GenerationRecord],
    progress: ProgressRecord | None,
    timings: dict[int, dict[int, RecoveryTimings]],
    injected: dict[str, float],
    workers: list[WorkerInfo],
    nodes_alive: int,
    last_eval: EvalResult | None = None,
    save_failures: int = 0,
) -> Snapshot:
    """What the endpoint serves for plan node `node`, given the job's state (see the module doc).

    `progress` is the job's progress record (None before the first commit); `seq_len` None (the
    job config not read yet) leaves tokens/s out; `last_eval` is the `eval` key (None: none yet);
    `save_failures` the job's failed checkpoint saves (the counts of `checkpoint-failures/`)."""
    last = progress
    tokens_per_s = None
    if last is not None and seq_len and last.generation in plans:
        tokens_per_s = _tokens_per_s(last, plans[last.generation].plan.global_batch * seq_len, window)
    finished: list[Recovery] = []
    node_bytes = job_bytes = 0
    for g, rec in sorted(plans.items()):
        got = timings.get(g, {})
        world = len(rec.plan.nodes) * rec.plan.gpus_per_node
        coords = assign_ranks(rec.plan)
        for rank, t in got.items():
            job_bytes += t.reconfig.bytes_fetched
            if rank < len(coords) and coords[rank].node == node:
                node_bytes += t.reconfig.bytes_fetched
        superseded = any(later > g for later in plans)
        if g > 1 and got and (len(got) >= world or superseded):
            finished.append(recovery_of(g, rec, list(got.values()), injected))
    return Snapshot(
        step=last.step + 1 if last else 0,
        loss=last.loss if last else None,
        step_seconds=last.seconds if last else None,
        tokens_per_s=tokens_per_s,
        generation=max(plans, default=0),
        recoveries=sum(1 for g in plans if g > 1),
        finished=finished,
        node_bytes=node_bytes,
        job_bytes=job_bytes,
        workers=len(workers),
        workers_alive=sum(1 for w in workers if _alive(w.pid)),
        nodes_alive=nodes_alive,
        eval_loss=None if last_eval is None else last_eval.loss,
        eval_step=None if last_eval is None else last_eval.step,
        checkpoint_save_failures=save_failures,
    )


def _tokens_per_s(record: ProgressRecord, tokens: int, window: int) -> float | None:
    """Tokens per second over the last `window` steps of the record's recent window (commit to
    commit), or of its last step alone when the window holds one."""
    recent = record.recent[-window:]
    span = recent[-1][1] - recent[0][1] if recent else 0.0
    if len(recent) >= 2 and span > 0:
        return tokens * (len(recent) - 1) / span
    return tokens / record.seconds if record.seconds > 0 else None


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def families(snap: Snapshot, *, job: str, node: int) -> Iterator[Metric]:
    """The Prometheus metric families of one snapshot (names and types: module doc)."""
    yield InfoMetricFamily(
        "elastic_node", "Job and node of this endpoint.", value={"job_id": job, "node": str(node)}
    )
    yield _gauge("elastic_step", "Steps committed (index of the last committed step + 1).", snap.step)
    if snap.loss is not None:
        yield _gauge("elastic_loss", "Loss of the last committed step.", snap.loss)
    if snap.step_seconds is not None:
        yield _gauge("elastic_step_seconds", "Wall time of the last committed step.", snap.step_seconds)
    if snap.tokens_per_s is not None:
        yield _gauge("elastic_tokens_per_second", "Tokens per second over the recent committed steps.",
                     snap.tokens_per_s)
    yield _gauge("elastic_generation", "Latest published generation.", snap.generation)
    yield CounterMetricFamily(
        "elastic_recoveries", "Generations published after the first.", value=snap.recoveries
    )
    if snap.finished:
        last = snap.finished[-1]
        yield _gauge("elastic_last_recovery_seconds", "Latest finished recovery, fault to first commit.",
                     last.total_s)
        phases = GaugeMetricFamily("elastic_last_recovery_phase_seconds", "Latest finished recovery by phase.",
                                   labels=["phase"])
        for phase in PHASES:
            phases.add_metric([phase], last.phases[phase])
        yield phases
    totals = [r.total_s for r in snap.finished]
    buckets = [(str(b), float(sum(1 for t in totals if t <= b))) for b in BUCKETS]
    buckets.append(("+Inf", float(len(totals))))
    yield HistogramMetricFamily("elastic_recovery_seconds", "Seconds of each finished recovery.",
                                buckets=buckets, sum_value=sum(totals))
    yield CounterMetricFamily("elastic_transfer_bytes", "Shard bytes fetched by this node's workers.",
                              value=snap.node_bytes)
    yield CounterMetricFamily("elastic_job_transfer_bytes", "Shard bytes fetched by every worker of the job.",
                              value=snap.job_bytes)
    yield _gauge("elastic_workers", "Workers this node registered.", snap.workers)
    yield _gauge(
        "elastic_workers_alive", "Registered workers of this node that are running.", snap.workers_alive
    )
    yield _gauge("elastic_nodes_alive", "Members of the job with a live lease.", snap.nodes_alive)
    yield CounterMetricFamily("elastic_checkpoint_save_failures", "Checkpoint saves of the job that failed.",
                              value=snap.checkpoint_save_failures)
    yield _gauge("elastic_spares", "Hot spares: live members the latest generation does not include.", snap.spares)
    yield _gauge("elastic_node_spare", "1 while this node is a hot spare.", float(snap.node_spare))
    if snap.eval_loss is not None and snap.eval_step is not None:
        yield _gauge("elastic_eval_loss", "Latest validation loss on the held-out split.", snap.eval_loss)
        yield _gauge("elastic_eval_step", "Steps committed when the latest validation loss was computed.",
                     snap.eval_step)


class NodeMetrics(Collector):
    """The metrics endpoint of one node (module doc); `start` serves it, `stop` ends it."""

    def __init__(self, client: EtcdClient, keys: JobKeys, *, node: int, lease: int | None = None,
                 window: int = 10) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 step, got {window}")
        self.client, self.keys, self.node, self.lease, self.window = client, keys, node, lease, window
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._mirrors: dict[str, _Mirror] = {}
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._seq_len: int | None = None
        self.address: str | None = None
        """`host:port` of the endpoint once started."""

    def start(self, host: str | None = None, port: int | None = None) -> NodeMetrics:
        """Mirror the job's state, serve `/metrics` on host:port and publish the address; returns self.

        `host` defaults to bind_host(), `port` to $ELASTIC_METRICS_PORT, else 0 (a free port).
        """
        if self._server is not None:
            raise RuntimeError("NodeMetrics already started")
        host = host or bind_host()
        if port is None:
            raw = os.environ.get(PORT_ENV, "0").strip() or "0"
            if not raw.isdigit():
                raise ValueError(f"{PORT_ENV}={raw!r} is not a port number")
            port = int(raw)
        rk = RunKeys(self.keys)
        self._mirrors = {
            "plans": _Mirror(self.client, self.keys.plans, GenerationRecord.from_json),
            "progress": _Mirror(self.client, rk.progress, ProgressRecord.from_json),
            "recoveries": _Mirror(self.client, rk.recoveries, RecoveryTimings.from_json),
            "workers": _Mirror(self.client, rk.node_workers(self.node), WorkerInfo.from_json),
            "members": _Mirror(self.client, self.keys.members, lambda v: v),
            "injected": _Mirror(self.client, rk.injected(""), lambda v: float(v.decode())),
            "eval": _Mirror(self.client, eval_key(self.keys), EvalResult.from_json),
            "save_failures": _Mirror(self.client, save_failures_prefix(self.keys), SaveFailures.from_json),
        }
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        bound_host, bound_port = self._server.server_address[:2]
        self.address = f"{bound_host}:{bound_port}"
        value = json.dumps({"address": self.address})
        if self.lease is not None:
            self.client.put(metrics_key(self.keys, self.node), value, lease=self.lease)
        else:
            self.client.put(metrics_key(self.keys, self.node), value)
        return self

    def stop(self) -> None:
        """Stop serving and watching, and withdraw the published address (if it is still ours)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for mirror in self._mirrors.values():
            mirror.close()
        if self.address is not None:
            key = metrics_key(self.keys, self.node)
            try:
                value, _ = self.client.get(key)
                if value is not None and json.loads(value).get("address") == self.address:
                    self.client.delete(key)
            except Exception as exc:  # etcd gone at shutdown: the key goes with the lease or the job
                log.warning("metrics: could not withdraw %s: %s", key, exc)
        self.address = None

    def _seq(self) -> int | None:
        if self._seq_len is None:
            raw, _ = self.client.get(RunKeys(self.keys).config)
            if raw is not None:
                self._seq_len = shape_of_spec(json.loads(raw)["spec"]).seq_len
        return self._seq_len

    def snapshot(self) -> Snapshot:
        """The values a scrape serves now."""
        m = {name: mirror.items() for name, mirror in self._mirrors.items()}
        timings: dict[int, dict[int, RecoveryTimings]] = {}
        for key, t in m["recoveries"].items():
            g, rank = key.split("/")
            timings.setdefault(int(g), {})[int(rank)] = t
        try:
            seq_len = self._seq()
        except Exception as exc:  # etcd unreachable: serve what the mirrors hold
            log.warning("metrics: cannot read the job config: %s", exc)
            seq_len = None
        return snapshot(
            node=self.node,
            seq_len=seq_len,
            window=self.window,
            plans={int(k): v for k, v in m["plans"].items()},
            progress=m["progress"].get(""),
            timings=timings,
            injected=m["injected"],
            workers=list(m["workers"].values()),
            nodes_alive=len(m["members"]),
            last_eval=m["eval"].get(""),
            save_failures=sum(r.count for r in m["save_failures"].values()),
        )

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        spares = spare_members(self._mirrors["members"].items(), self._mirrors["plans"].items())
        snap = replace(snap, spares=len(spares), node_spare=self.node in spares)
        yield from families(snap, job=self.keys.job, node=self.node)
        yield from self._speed()

    def _speed(self) -> Iterator[Metric]:
        """This node's busy seconds, speed factor and straggler mark: one read of the `stragglers`
        key a scrape (no watch: it is rewritten up to once a second and only scrapes need it)."""
        try:
            record = read_stragglers(self.client, self.keys)
        except Exception as exc:  # etcd unreachable or an unreadable record: leave these out
            log.warning("metrics: cannot read the stragglers record: %s", exc)
            return
        if record is None or self.node not in record.factors:
            return
        if self.node in record.busy:
            yield _gauge("elastic_node_busy_seconds", "This node's compute seconds a step: forward plus backward.",
                         record.busy[self.node])
        for phase, seconds in zip(STEP_PHASES, record.phases.get(self.node, []), strict=False):
            yield _gauge(f"elastic_node_{phase}_seconds", f"This node's {phase} seconds a step (median).", seconds)
        yield _gauge("elastic_node_speed_factor", "This node's seconds per unit of work over its peers' median.",
                     record.factors[self.node])
        yield _gauge("elastic_node_straggler", "1 while this node is marked as a straggler.",
                     float(self.node in record.marked))
