"""The Prometheus exposition of a metrics `Snapshot` (metrics_snapshot.py): one metric family per
served value, with the names, types and help texts of metrics.py's table."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from elastic.ops.metrics_snapshot import PHASES, Snapshot

BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
"""Upper bounds (seconds) of the recovery histogram's buckets (+Inf is added)."""


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    """A gauge family of one unlabelled value."""
    return GaugeMetricFamily(name, doc, value=value)


def families(snap: Snapshot, *, job: str, node: int) -> Iterator[Metric]:
    """The Prometheus metric families of one snapshot (names and types: metrics.py's doc)."""
    yield InfoMetricFamily(
        "elastic_node", "Job and node of this endpoint.", value={"job_id": job, "node": str(node)}
    )
    yield gauge("elastic_step", "Steps committed (index of the last committed step + 1).", snap.step)
    if snap.loss is not None:
        yield gauge("elastic_loss", "Loss of the last committed step.", snap.loss)
    if snap.step_seconds is not None:
        yield gauge("elastic_step_seconds", "Wall time of the last committed step.", snap.step_seconds)
    if snap.tokens_per_s is not None:
        yield gauge("elastic_tokens_per_second", "Tokens per second over the recent committed steps.",
                     snap.tokens_per_s)
    yield gauge("elastic_generation", "Latest published generation.", snap.generation)
    yield CounterMetricFamily(
        "elastic_recoveries", "Generations published after the first.", value=snap.recoveries
    )
    if snap.finished:
        last = snap.finished[-1]
        yield gauge("elastic_last_recovery_seconds", "Latest finished recovery, fault to first commit.",
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
    yield gauge("elastic_workers", "Workers this node registered.", snap.workers)
    yield gauge(
        "elastic_workers_alive", "Registered workers of this node that are running.", snap.workers_alive
    )
    yield gauge("elastic_nodes_alive", "Members of the job with a live lease.", snap.nodes_alive)
    yield CounterMetricFamily("elastic_checkpoint_save_failures", "Checkpoint saves of the job that failed.",
                              value=snap.checkpoint_save_failures)
    yield gauge("elastic_spares", "Hot spares: live members the latest generation does not include.", snap.spares)
    yield gauge("elastic_node_spare", "1 while this node is a hot spare.", float(snap.node_spare))
    yield CounterMetricFamily("elastic_suspects_cleared", "Nodes whose lease expired that answered the leader's probe.",
                              value=snap.suspects_cleared)
    if snap.eval_loss is not None and snap.eval_step is not None:
        yield gauge("elastic_eval_loss", "Latest validation loss on the held-out split.", snap.eval_loss)
        yield gauge("elastic_eval_step", "Steps committed when the latest validation loss was computed.",
                     snap.eval_step)
