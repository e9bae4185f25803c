"""Run the policies over one trace and measure them against two references.

- failure-free: the samples the elastic policy's initial plan (the planner's fastest plan
  with >= f+1 pipelines over all N nodes) trains in the horizon with no failure at all;
  `effective` = a policy's samples / these.
- ideal: for every stretch of the trace with n live nodes, the samples the fastest elastic
  plan for n nodes trains in that stretch, switching plans for free at each change (only the
  partial step at a change is lost); `vs_ideal` = a policy's samples / these. It isolates the
  cost of recovering from the unavoidable loss of capacity.

Both references have every node at full speed: against them, a trace's slow nodes cost what no
policy wins back. When the trace slows nodes down, the elastic policy runs under the chosen
straggler policy (`stragglers`, elastic/sim/slowness.py) and once more with stragglers `off`,
a row of its own (`elastic (stragglers off)`), so that the runtime's reaction to slow nodes
appears beside doing nothing; the other policies do nothing about slow nodes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from elastic.planning.cluster import ClusterSpec, cluster_profile
from elastic.sim.checkpoint_policy import CheckpointRestartPolicy
from elastic.sim.config import RecoveryCosts
from elastic.sim.elastic_policy import ElasticPolicy
from elastic.sim.planbook import PlanBook
from elastic.sim.recycle_policy import RecyclePolicy
from elastic.sim.redundant_policy import RedundantPolicy
from elastic.sim.result import PolicyResult, whole_steps
from elastic.sim.slowness import STRAGGLER_POLICIES
from elastic.sim.trace import Trace

POLICIES = ("elastic", "checkpoint-restart", "redundant", "recycle")
REPORT_VERSION = 1
STRAGGLERS_OFF = "elastic (stragglers off)"
"""The extra row of a trace with slow nodes: the elastic policy doing nothing about them."""


@dataclass(frozen=True, kw_only=True)
class References:
    """The two yardsticks, in samples."""

    failure_free_samples: int
    """The initial plan running the whole horizon."""
    ideal_samples: int
    """The fastest plan for the live node count at every moment, switched for free."""
    initial_iteration_s: float
    """Iteration time of the initial elastic plan."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "failure_free_samples": self.failure_free_samples,
            "ideal_samples": self.ideal_samples,
            "initial_iteration_s": self.initial_iteration_s,
        }


def references(book: PlanBook, trace: Trace, horizon_s: float) -> References:
    batch = book.cluster.global_batch
    initial = book.initial_plan().iteration_time
    ideal_steps = 0
    counts = trace.until(horizon_s).live_counts()
    for (start, n), (end, _) in zip(counts, [*counts[1:], (horizon_s, 0)], strict=True):
        t = book.best_time(n)
        if t is not None:
            ideal_steps += whole_steps(end - start, t)
    return References(
        failure_free_samples=whole_steps(horizon_s, initial) * batch,
        ideal_samples=ideal_steps * batch,
        initial_iteration_s=initial,
    )


def make_policy(name: str, book: PlanBook, costs: RecoveryCosts, *, spares: int = 0,
                stragglers: str = "rebalance") -> Any:
    """The policy `name` (or STRAGGLERS_OFF); `spares`: the elastic policy's hot spares (the
    others have none); `stragglers`: the elastic policy's straggler policy."""
    if name == "elastic":
        return ElasticPolicy(book, costs, spares=spares, stragglers=stragglers)
    if name == STRAGGLERS_OFF:
        return ElasticPolicy(book, costs, spares=spares, stragglers="off", name=STRAGGLERS_OFF)
    if name == "checkpoint-restart":
        return CheckpointRestartPolicy(book, costs)
    if name == "redundant":
        return RedundantPolicy(book, costs)
    if name == "recycle":
        return RecyclePolicy(book, costs)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")


def run_policy(name: str, book: PlanBook, costs: RecoveryCosts, trace: Trace, horizon_s: float, *,
               spares: int = 0, stragglers: str = "rebalance") -> PolicyResult:
    """One policy over `trace` up to `horizon_s` (`spares`: the elastic policy's hot spares;
    `stragglers`: its straggler policy)."""
    policy = make_policy(name, book, costs, spares=spares, stragglers=stragglers)
    result: PolicyResult = policy.run(trace, horizon_s)
    return result


def simulate(
    cluster: ClusterSpec,
    costs: RecoveryCosts,
    trace: Trace,
    *,
    horizon_s: float,
    policies: tuple[str, ...] = POLICIES,
    spares: int = 0,
    stragglers: str = "rebalance",
) -> dict[str, Any]:
    """The full report (stable JSON fields): inputs, references and one entry per policy.
    `spares`: hot spares beside the trace's nodes for the elastic policy (`elastic simulate --spares`);
    `stragglers`: the elastic policy's straggler policy (`--straggler-policy`), which matters only
    when the trace slows nodes down (then the report has the STRAGGLERS_OFF row too)."""
    if not horizon_s > 0:
        raise ValueError(f"the simulated time must be > 0, got {horizon_s} s")
    if trace.initial_nodes != cluster.nodes:
        raise ValueError(f"the trace starts with {trace.initial_nodes} nodes but the cluster has {cluster.nodes}")
    unknown = [name for name in policies if name not in POLICIES]
    if unknown or not policies:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    if stragglers not in STRAGGLER_POLICIES:
        raise ValueError(f"--straggler-policy must be one of {', '.join(STRAGGLER_POLICIES)}, got {stragglers!r}")
    book = PlanBook(cluster, cluster_profile(cluster), redundant_forward=costs.redundant_forward)
    refs = references(book, trace, horizon_s)
    seen = trace.until(horizon_s)
    rows: list[str] = []
    for name in policies:
        rows.append(name)
        if name == "elastic" and seen.slowdowns and stragglers != "off":
            rows.append(STRAGGLERS_OFF)  # the runtime's straggler policy beside doing nothing
    out = []
    for name in rows:
        res = run_policy(name, book, costs, trace, horizon_s, spares=spares, stragglers=stragglers)
        entry = res.to_dict()
        entry["effective"] = res.samples / refs.failure_free_samples if refs.failure_free_samples else 0.0
        entry["vs_ideal"] = res.samples / refs.ideal_samples if refs.ideal_samples else 0.0
        out.append(entry)
    return {
        "version": REPORT_VERSION,
        "cluster": asdict(cluster),
        "costs": costs.to_dict(),
        "horizon_s": horizon_s,
        "profile": {"source": book.profile.source, "notes": book.profile.notes, "model_bytes": book.model_bytes},
        "trace": {
            "description": trace.description,
            "failures": seen.failures,
            "joins": seen.joins,
            **({"causes": seen.causes()} if seen.causes() else {}),  # only when events name their cause
            **({"slowdowns": seen.slowdowns} if seen.slowdowns else {}),
            "events": seen.to_list(),
        },
        "references": refs.to_dict(),
        "policies": out,
        **({"spares": spares} if spares else {}),  # only with spares: the fields without them stay as they were
        **({"stragglers": straggler_notes(stragglers)} if seen.slowdowns else {}),  # only with slow nodes, likewise
    }


def straggler_notes(stragglers: str) -> dict[str, Any]:
    """The report's account of slow nodes (a trace with slowdowns only)."""
    rows = "" if stragglers == "off" else f"; the row {STRAGGLERS_OFF!r} is the same policy doing nothing about them"
    return {
        "policy": stragglers,
        "notes": [
            f"elastic runs straggler policy {stragglers}{rows}",
            "checkpoint-restart and redundant do nothing about slow nodes (each step waits for the slowest pipeline)",
            "the references (failure-free, ideal) have every node at full speed",
        ],
    }
