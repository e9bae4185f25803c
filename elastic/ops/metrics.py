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
| elastic_suspects_cleared_total | counter | | nodes whose lease expired but whose agent answered the leader's probe, so they kept their place (the `suspicion` key, elastic/roles/leader_suspects.py) |
| elastic_node_busy_seconds | gauge | | this node's compute seconds a step, forward plus backward (median of the last 5; the `stragglers` key, read at scrape time) |
| elastic_node_forward_seconds | gauge | | of those, its forward passes' (median of the last 5; elastic/parallel/phase_clock.py) |
| elastic_node_backward_seconds | gauge | | of those, its backward passes' (median of the last 5) |
| elastic_node_wait_seconds | gauge | | its seconds a step blocked on pipeline peers (median of the last 5) |
| elastic_node_speed_factor | gauge | | those seconds per unit of work over its peers' median (elastic/planning/stragglers.py) |
| elastic_node_straggler | gauge | | 1 while this node is marked as a straggler, else 0 |

This file holds the endpoint (`NodeMetrics`: its mirrors, HTTP server and published address) and
the address keys. The values come from `metrics_snapshot.py` (a `Snapshot` of the mirrored state),
their exposition as metric families from `metrics_families.py`, the mirrors from `elastic/coordinator/prefix_mirror.py`.

A recovery's breakdown follows elastic.roles.launcher_feed (the run summary's recovery entries),
so the gauges agree with `summary.json`; a recovery counts as finished once every worker of its
generation reported its timings, or a later generation superseded it after some did.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import replace

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.jsonrecord import unpack_text
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.coordinator.netaddr import bind_host
from elastic.coordinator.prefix_mirror import PrefixMirror
from elastic.ops.metrics_families import families, gauge
from elastic.ops.metrics_server import MetricsServer
from elastic.ops.metrics_snapshot import Snapshot, snapshot, spare_members
from elastic.parallel.phase_clock import STEP_PHASES
from elastic.records.checkpoint_failures import SaveFailures, save_failures_prefix
from elastic.records.evals import EvalResult, eval_key
from elastic.records.generation import GenerationRecord
from elastic.records.job import shape_of_spec
from elastic.records.node_workers import worker_infos
from elastic.records.progress import ProgressRecord
from elastic.records.recovery_timings import SUMMARY_NODE, RecoveryTimings
from elastic.records.stragglers import read_stragglers
from elastic.records.suspicion import SuspicionRecord
from elastic.records.workers import node_id

log = logging.getLogger(__name__)

PORT_ENV = "ELASTIC_METRICS_PORT"


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


class NodeMetrics(Collector):
    """The metrics endpoint of one node (module doc); `start` serves it, `stop` ends it."""

    def __init__(self, client: EtcdClient, keys: JobKeys, *, node: int, lease: int | None = None,
                 window: int = 10) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 step, got {window}")
        self.client, self.keys, self.node, self.lease, self.window = client, keys, node, lease, window
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._mirrors: dict[str, PrefixMirror] = {}
        self._server: MetricsServer | None = None
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
            "plans": PrefixMirror(self.client, self.keys.plans, GenerationRecord.from_json),
            "progress": PrefixMirror(self.client, rk.progress, ProgressRecord.from_json),
            "recoveries": PrefixMirror(self.client, rk.recoveries, RecoveryTimings.from_json),
            "workers": PrefixMirror(self.client, rk.node_workers(self.node), worker_infos),
            "members": PrefixMirror(self.client, self.keys.members, lambda v: v),
            "injected": PrefixMirror(self.client, rk.injected(""), lambda v: float(v.decode())),
            "eval": PrefixMirror(self.client, eval_key(self.keys), EvalResult.from_json),
            "save_failures": PrefixMirror(self.client, save_failures_prefix(self.keys), SaveFailures.from_json),
            "suspicion": PrefixMirror(self.client, self.keys.suspicion, SuspicionRecord.from_json),
        }
        self._server = MetricsServer(self.registry, host=host, port=port)
        bound_host, bound_port = self._server.address
        self.address = f"{bound_host}:{bound_port}"
        value = json.dumps({"address": self.address})
        if self.lease is not None:
            self.client.put(metrics_key(self.keys, self.node), value, lease=self.lease)
        else:
            self.client.put(metrics_key(self.keys, self.node), value)
        return self

    def relet(self, lease: int) -> None:
        """Publish the address again on `lease`: the node registered again after its lease
        expired while it lived (an etcd stall), and the old key went with the old lease."""
        self.lease = lease
        if self.address is not None:
            self.client.put(metrics_key(self.keys, self.node), json.dumps({"address": self.address}), lease=lease)

    def stop(self) -> None:
        """Stop serving and watching, and withdraw the published address (if it is still ours)."""
        if self._server is not None:
            self._server.close()
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
                self._seq_len = shape_of_spec(json.loads(unpack_text(raw))["spec"]).seq_len
        return self._seq_len

    def snapshot(self) -> Snapshot:
        """The values a scrape serves now."""
        m = {name: mirror.items() for name, mirror in self._mirrors.items()}
        timings: dict[int, dict[int, RecoveryTimings]] = {}
        for key, t in m["recoveries"].items():
            g, node = key.split("/")  # one record a node (its workers' folded), or "all": the generation's
            timings.setdefault(int(g), {})[SUMMARY_NODE if node == "all" else int(node)] = t
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
            workers=[info for infos in m["workers"].values() for info in infos],
            nodes_alive=len(m["members"]),
            last_eval=m["eval"].get(""),
            save_failures=sum(r.count for r in m["save_failures"].values()),
        )

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        spares = spare_members(self._mirrors["members"].items(), self._mirrors["plans"].items())
        suspicion = self._mirrors["suspicion"].items().get("")
        snap = replace(snap, spares=len(spares), node_spare=self.node in spares,
                       suspects_cleared=0 if suspicion is None else suspicion.cleared_total)
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
            yield gauge("elastic_node_busy_seconds", "This node's compute seconds a step: forward plus backward.",
                         record.busy[self.node])
        for phase, seconds in zip(STEP_PHASES, record.phases.get(self.node, []), strict=False):
            yield gauge(f"elastic_node_{phase}_seconds", f"This node's {phase} seconds a step (median).", seconds)
        yield gauge("elastic_node_speed_factor", "This node's seconds per unit of work over its peers' median.",
                     record.factors[self.node])
        yield gauge("elastic_node_straggler", "1 while this node is marked as a straggler.",
                     float(self.node in record.marked))
