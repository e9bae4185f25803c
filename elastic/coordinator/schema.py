"""The etcd schema of a job: every key under `/elastic/<job>/`, in one table (`SCHEMA`).

Each row is a key family: its name, its pattern below the job root, the lease it lives on, who
writes it, who reads it and what it means. The key builders of `JobKeys` and `RunKeys`
(elastic/coordinator/keys.py) and the record modules' key functions all build their keys from
these patterns (`key`, `prefix`), so no key string is written twice; `family_of` finds the row of
a key, and tests/coordinator/test_schema.py checks that every key a real run writes has one.

Pattern fields: `{name}` is one key segment (no '/'); `{name:d}` an integer (`:012d`, `:020d`
zero-padded to that width); `{name*}` the rest of the key, which may hold '/'. Leases: "node"
is the node's membership lease (held by its agent), "leader" the elected leader's lease, "none"
a key that outlives its writer (the leader deletes a finished generation's halt/, sync/, ready/,
decisions/ and store/ keys). Values: a record written with `JsonRecord.to_packed` (config, plan/,
and a node's folded records: node-workers, node-holdings, node-sync, recoveries, recovered) is
zlib-packed when that is shorter (elastic/coordinator/jsonrecord.py); every reader takes both.
The table, as `table()` renders it:

| family | pattern | lease | writer | readers | meaning |
| --- | --- | --- | --- | --- | --- |
| members | `members/{node_id}` | node | agent (Membership) | leader, launcher, rendezvous, status, metrics | NodeIdentity JSON of a live node |
| failed | `failed/{node_id}/{incarnation:d}` | none | a member that saw the failure | leader, status | a failure report (who saw it, when, why) |
| suspects | `suspects/{node_id}/{incarnation:d}/{reporter}` | none | a worker whose collective failed | leader (Membership) | a suspicion raised by a collective error |
| probes | `probes/{node_id}/{incarnation:d}` | none | agent | leader (SuspectGuard) | host:port of the node incarnation's liveness probe (elastic/coordinator/probe.py) |
| suspicion | `suspicion` | none | leader (SuspectGuard) | status, metrics, events | SuspicionRecord: the latest lease expiries, the probes' answers, the decision |
| leader | `leader` | leader | the elected leader (Election) | candidates, status | the leader's id |
| generation | `generation` | none | leader (Generations.publish) | workers, agents, launcher, status | the latest generation number (decimal) |
| plan | `plan/{generation:012d}` | none | leader (Generations.publish) | workers, agents, launcher, status, events, metrics | GenerationRecord JSON, written once |
| injections | `injections/{request_id}` | none | CLI (inject, drain), launcher, agent, leader | agents, launcher, leader | InjectionRequest JSON |
| injection-status | `injection-status/{request_id}` | none | whoever carries the request out | CLI, launcher, agent, leader | InjectionStatus JSON |
| injected | `injected/{name*}` | none | agent, launcher | status, events, metrics, launcher | wall time an injection was carried out |
| events | `events/{time_ns:020d}-{who*}` | none | any process (record_event) | `elastic events`, status | the job's append-only event log |
| token | `token` | none | the first launcher (access.py) | CLI, agents | hash of the job token |
| fatal | `fatal` | none | leader; a worker whose repair finds moments lost (keys.worker_gave_up) | launcher, status | why the job cannot go on |
| config | `config` | none | launcher | workers, agents, status, CLI, metrics | ElasticConfig JSON: the job spec |
| workers | `workers/{node:d}/{local_rank:d}` | node | none since issue 34 (workers fold theirs into node-workers); still read | agent, leader, launcher, status, metrics, workers (holder map: a gRPC fetch only) | WorkerInfo JSON: pid, transfer address |
| node-workers | `workers/{node:d}/all` | node | agent (its workers' registrations folded; a worker without one folds its own in) | agent, leader, launcher, status, metrics, workers (holder map: a gRPC fetch only) | NodeWorkers: each of the node's workers' WorkerInfo (pid, transfer address) of its latest incarnation |
| holdings | `holdings/{node:d}/{local_rank:d}` | node | none since issue 34 (workers fold theirs into node-holdings); still read | leader, workers (holder map: a gRPC fetch only) | [[layer, tp_rank], ...] it held at its halt |
| node-holdings | `holdings/{node:d}/all` | node | agent, with the sync reports (its workers' folded, when they changed; a worker without one folds its own in) | leader, workers (holder map: a gRPC fetch only) | NodeHoldings: what each of the node's workers held at its halt |
| progress | `progress` | none | world rank 0 | launcher, status, metrics, workers | ProgressRecord of the last committed step |
| step-waiters | `step-waiters/{name}` | node | agent (InjectionTrigger); launcher (a rejoin at a step) and netns partitioner, leaseless, deleted when done | world rank 0 (ProgressWriter) | someone waits for a step: progress puts at the short interval |
| stragglers | `stragglers` | none | world rank 0 | leader, status, metrics | StragglerRecord: speed factors and marks |
| straggler-policy | `straggler-policy` | none | `elastic stragglers` | world rank 0, leader | PolicyOverride of the straggler settings |
| halt | `halt/{generation:d}` | none | leader | workers, job stop | HaltRecord: generation g is to stop |
| stop | `stop` | none | launcher (Ctrl-C, SIGTERM), `elastic drain --all` | leader | StopRequest: stop the job with a checkpoint |
| sync | `sync/{generation:d}/{node:d}/{local_rank:d}` | none | none since issue 34 (workers fold theirs into node-sync); still read | leader | SyncReport: what it committed |
| node-sync | `sync/{generation:d}/{node:d}/all` | none | agent (its workers' folded; a worker without one folds its own in) | leader | NodeSyncReports: what each of the node's workers committed |
| ready | `ready/{generation:d}/{step:d}/{rank:d}` | none | worker (the job's last step only) | leader | its vote of the last step succeeded |
| decisions | `decisions/{generation:d}/{step:d}` | none | leader (the job's last step only) | workers | "commit" or "abort", created once |
| recoveries | `recoveries/{generation:d}/{node:d}` | none | agent (its workers' folded; a worker without one folds its own in) | status, events, metrics, launcher | RecoveryTimings of the node's workers' move into g |
| recovered | `recoveries/{generation:d}/all` | none | leader (when g+1 is published) | status, events, metrics, launcher | RecoveryTimings of every worker's move into g, the node records folded |
| done | `done/{node:d}/{local_rank:d}` | none | worker | launcher, status, job stop | it finished (its last step, "stopped", "drained", "spare") |
| eval | `eval` | none | world rank 0 | launcher, status, metrics | EvalResult of the latest evaluation |
| checkpoint-failures | `checkpoint-failures/{node:d}/{local_rank:d}/{incarnation:d}` | none | worker | status, metrics | SaveFailures: its failed checkpoint saves |
| metrics | `metrics/{node_id}` | node | agent (NodeMetrics) | `elastic metrics`, status | {"address": host:port} of its metrics endpoint |
| store | `store/{scope}/{key*}` | none | workers (EtcdStore) | workers | c10d Store keys, one scope per generation (`gen-<g>`) |
| rdzv-closed | `rdzv/closed` | none | torchrun rendezvous | torchrun rendezvous | the rendezvous is closed |
| rdzv-round | `rdzv/round` | none | torchrun rendezvous | torchrun rendezvous | the sealed round: {"round", "nodes"} |
| rdzv-waiting | `rdzv/waiting/{node_id}` | node | torchrun rendezvous | torchrun rendezvous | a node waiting for the next round |
| rdzv-incarnation | `rdzv/incarnation/{node_id}` | none | torchrun rendezvous | torchrun rendezvous | the node's incarnation counter |
| rdzv-store | `rdzv/round-{round:d}/store/{key*}` | none | torchrun's agents and workers | the same | c10d Store keys of one rendezvous round |

Node ids in etcd are `node<k>` for plan node k (elastic/records/workers.py); a node's
incarnation counts its (re)starts.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

ROOT = "/elastic/"
"""Every job's keys live under `ROOT<job>/`."""

_FIELD = re.compile(r"\{(\w+)(\*)?(?::([^}]*))?\}")
"""One field of a pattern: `{name}`, `{name*}` or `{name:spec}`."""


@dataclass(frozen=True)
class Family:
    """One row of the schema: a family of keys below the job root."""

    name: str
    """Short name; the builders take it (`key(root, "sync", g, node, local_rank)`)."""
    pattern: str
    """The keys below the job root, with fields (module doc)."""
    lease: str
    """"node", "leader" or "none"."""
    writer: str
    """Who writes these keys."""
    readers: str
    """Who reads them."""
    meaning: str
    """What one key says, in words."""

    def build(self, root: str, parts: Sequence[object], *, whole: bool) -> str:
        """The key (`whole`) or the prefix ending in '/' of `parts`, the pattern's first fields in
        order; the prefix stops before the first segment that a missing field leaves open."""
        out: list[str] = []
        used = 0
        segments = self.pattern.split("/")
        for segment in segments:
            fields = _FIELD.findall(segment)
            if used + len(fields) > len(parts):
                break
            out.append(_fill(segment, iter(parts[used : used + len(fields)])))
            used += len(fields)
        if used != len(parts) or (whole and len(out) != len(segments)):
            raise ValueError(f"key family {self.name!r} ({self.pattern}) takes its fields in order, got {parts!r}")
        return root + "/".join(out) + ("" if whole else "/")

    @cached_property
    def regex(self) -> re.Pattern[str]:
        """What the keys of this family look like below the job root."""
        out, end = [], 0
        for m in _FIELD.finditer(self.pattern):
            out.append(re.escape(self.pattern[end : m.start()]))
            spec = m.group(3) or ""
            width = re.fullmatch(r"0(\d+)d", spec)
            out.append(".+" if m.group(2) else rf"\d{{{width.group(1)}}}" if width else r"\d+" if spec == "d" else "[^/]+")
            end = m.end()
        out.append(re.escape(self.pattern[end:]))
        return re.compile("".join(out))


def _fill(segment: str, values: Iterator[object]) -> str:
    """`segment` with each field replaced by the next of `values`, formatted by its spec."""
    return _FIELD.sub(lambda m: format(next(values), m.group(3) or ""), segment)


def _f(name: str, pattern: str, lease: str, writer: str, readers: str, meaning: str) -> Family:
    return Family(name=name, pattern=pattern, lease=lease, writer=writer, readers=readers, meaning=meaning)


WORKERS = "workers, agents, launcher, status"
RDZV = "torchrun rendezvous"

SCHEMA: tuple[Family, ...] = (
    _f("members", "members/{node_id}", "node", "agent (Membership)",
       "leader, launcher, rendezvous, status, metrics", "NodeIdentity JSON of a live node"),
    _f("failed", "failed/{node_id}/{incarnation:d}", "none", "a member that saw the failure", "leader, status",
       "a failure report (who saw it, when, why)"),
    _f("suspects", "suspects/{node_id}/{incarnation:d}/{reporter}", "none", "a worker whose collective failed",
       "leader (Membership)", "a suspicion raised by a collective error"),
    _f("probes", "probes/{node_id}/{incarnation:d}", "none", "agent", "leader (SuspectGuard)",
       "host:port of the node incarnation's liveness probe (elastic/coordinator/probe.py)"),
    _f("suspicion", "suspicion", "none", "leader (SuspectGuard)", "status, metrics, events",
       "SuspicionRecord: the latest lease expiries, the probes' answers, the decision"),
    _f("leader", "leader", "leader", "the elected leader (Election)", "candidates, status", "the leader's id"),
    _f("generation", "generation", "none", "leader (Generations.publish)", WORKERS,
       "the latest generation number (decimal)"),
    _f("plan", "plan/{generation:012d}", "none", "leader (Generations.publish)",
       "workers, agents, launcher, status, events, metrics", "GenerationRecord JSON, written once"),
    _f("injections", "injections/{request_id}", "none", "CLI (inject, drain), launcher, agent, leader",
       "agents, launcher, leader", "InjectionRequest JSON"),
    _f("injection-status", "injection-status/{request_id}", "none", "whoever carries the request out",
       "CLI, launcher, agent, leader", "InjectionStatus JSON"),
    _f("injected", "injected/{name*}", "none", "agent, launcher", "status, events, metrics, launcher",
       "wall time an injection was carried out"),
    _f("events", "events/{time_ns:020d}-{who*}", "none", "any process (record_event)", "`elastic events`, status",
       "the job's append-only event log"),
    _f("token", "token", "none", "the first launcher (access.py)", "CLI, agents", "hash of the job token"),
    _f("fatal", "fatal", "none", "leader; a worker whose repair finds moments lost (keys.worker_gave_up)",
       "launcher, status", "why the job cannot go on"),
    _f("config", "config", "none", "launcher", "workers, agents, status, CLI, metrics",
       "ElasticConfig JSON: the job spec"),
    _f("workers", "workers/{node:d}/{local_rank:d}", "node",
       "none since issue 34 (workers fold theirs into node-workers); still read",
       "agent, leader, launcher, status, metrics, workers (holder map: a gRPC fetch only)", "WorkerInfo JSON: pid, transfer address"),
    _f("node-workers", "workers/{node:d}/all", "node",
       "agent (its workers' registrations folded; a worker without one folds its own in)",
       "agent, leader, launcher, status, metrics, workers (holder map: a gRPC fetch only)",
       "NodeWorkers: each of the node's workers' WorkerInfo (pid, transfer address) of its latest incarnation"),
    _f("holdings", "holdings/{node:d}/{local_rank:d}", "node",
       "none since issue 34 (workers fold theirs into node-holdings); still read",
       "leader, workers (holder map: a gRPC fetch only)", "[[layer, tp_rank], ...] it held at its halt"),
    _f("node-holdings", "holdings/{node:d}/all", "node",
       "agent, with the sync reports (its workers' folded, when they changed; a worker without one folds its own in)",
       "leader, workers (holder map: a gRPC fetch only)", "NodeHoldings: what each of the node's workers held at its halt"),
    _f("progress", "progress", "none", "world rank 0", "launcher, status, metrics, workers",
       "ProgressRecord of the last committed step"),
    _f("step-waiters", "step-waiters/{name}", "node",
       "agent (InjectionTrigger); launcher (a rejoin at a step) and netns partitioner, leaseless, deleted when done",
       "world rank 0 (ProgressWriter)", "someone waits for a step: progress puts at the short interval"),
    _f("stragglers", "stragglers", "none", "world rank 0", "leader, status, metrics",
       "StragglerRecord: speed factors and marks"),
    _f("straggler-policy", "straggler-policy", "none", "`elastic stragglers`", "world rank 0, leader",
       "PolicyOverride of the straggler settings"),
    _f("halt", "halt/{generation:d}", "none", "leader", "workers, job stop", "HaltRecord: generation g is to stop"),
    _f("stop", "stop", "none", "launcher (Ctrl-C, SIGTERM), `elastic drain --all`", "leader",
       "StopRequest: stop the job with a checkpoint"),
    _f("sync", "sync/{generation:d}/{node:d}/{local_rank:d}", "none",
       "none since issue 34 (workers fold theirs into node-sync); still read", "leader",
       "SyncReport: what it committed"),
    _f("node-sync", "sync/{generation:d}/{node:d}/all", "none", "agent (its workers' folded; a worker without one folds its own in)",
       "leader", "NodeSyncReports: what each of the node's workers committed"),
    _f("ready", "ready/{generation:d}/{step:d}/{rank:d}", "none", "worker (the job's last step only)", "leader",
       "its vote of the last step succeeded"),
    _f("decisions", "decisions/{generation:d}/{step:d}", "none", "leader (the job's last step only)", "workers",
       "\"commit\" or \"abort\", created once"),
    _f("recoveries", "recoveries/{generation:d}/{node:d}", "none", "agent (its workers' folded; a worker without one folds its own in)",
       "status, events, metrics, launcher", "RecoveryTimings of the node's workers' move into g"),
    _f("recovered", "recoveries/{generation:d}/all", "none", "leader (when g+1 is published)",
       "status, events, metrics, launcher", "RecoveryTimings of every worker's move into g, the node records folded"),
    _f("done", "done/{node:d}/{local_rank:d}", "none", "worker", "launcher, status, job stop",
       "it finished (its last step, \"stopped\", \"drained\", \"spare\")"),
    _f("eval", "eval", "none", "world rank 0", "launcher, status, metrics", "EvalResult of the latest evaluation"),
    _f("checkpoint-failures", "checkpoint-failures/{node:d}/{local_rank:d}/{incarnation:d}", "none", "worker",
       "status, metrics", "SaveFailures: its failed checkpoint saves"),
    _f("metrics", "metrics/{node_id}", "node", "agent (NodeMetrics)", "`elastic metrics`, status",
       "{\"address\": host:port} of its metrics endpoint"),
    _f("store", "store/{scope}/{key*}", "none", "workers (EtcdStore)", "workers",
       "c10d Store keys, one scope per generation (`gen-<g>`)"),
    _f("rdzv-closed", "rdzv/closed", "none", RDZV, RDZV, "the rendezvous is closed"),
    _f("rdzv-round", "rdzv/round", "none", RDZV, RDZV, "the sealed round: {\"round\", \"nodes\"}"),
    _f("rdzv-waiting", "rdzv/waiting/{node_id}", "node", RDZV, RDZV, "a node waiting for the next round"),
    _f("rdzv-incarnation", "rdzv/incarnation/{node_id}", "none", RDZV, RDZV, "the node's incarnation counter"),
    _f("rdzv-store", "rdzv/round-{round:d}/store/{key*}", "none", "torchrun's agents and workers", "the same",
       "c10d Store keys of one rendezvous round"),
)
"""Every key family of a job, in the order of the module doc's table."""

FAMILIES: dict[str, Family] = {f.name: f for f in SCHEMA}


def family(name: str) -> Family:
    """The row named `name`; ValueError for a name the table does not list."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"no key family {name!r} in the etcd schema (elastic/coordinator/schema.py)") from None


def key(root: str, name: str, *parts: object) -> str:
    """The key of family `name` under the job root `root`, every field given in pattern order."""
    return family(name).build(root, parts, whole=True)


def prefix(root: str, name: str, *parts: object) -> str:
    """The prefix (ending in '/') of the keys of family `name` whose first fields are `parts`."""
    return family(name).build(root, parts, whole=False)


def family_of(relative: str) -> Family | None:
    """The row whose pattern matches `relative` (a key below the job root); None if none does."""
    for f in SCHEMA:
        if f.regex.fullmatch(relative):
            return f
    return None


def table() -> str:
    """The schema as the Markdown table of the module doc."""
    rows = ["| family | pattern | lease | writer | readers | meaning |", "| --- | --- | --- | --- | --- | --- |"]
    rows += [f"| {f.name} | `{f.pattern}` | {f.lease} | {f.writer} | {f.readers} | {f.meaning} |" for f in SCHEMA]
    return "\n".join(rows)
