"""What a recovery entry says, read from a generation record, every worker's recovery timings and
the injections carried out: the launcher's summary, `elastic status`, `elastic events` and the
metrics all build their recovery entries here, so they agree."""

from __future__ import annotations

from typing import Any

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.keys import RunKeys
from elastic.records.generation import GenerationRecord
from elastic.records.recovery_timings import RecoveryTimings, distinct


def change_words(lost: list[int], joined: list[int], drained: list[int]) -> str:
    """A generation's change of membership in words, e.g. "lost [2], joined [4]" or "drained [1]"."""
    parts = [f"{what} {nodes}" for what, nodes in (("lost", lost), ("joined", joined), ("drained", drained)) if nodes]
    return ", ".join(parts) or "no change of nodes"


def replayed_words(rec: GenerationRecord) -> str:
    """How much of the interrupted step a generation computes again, in words."""
    fraction = rec.replayed_fraction
    if fraction is None:
        return "no step interrupted" if rec.restore_checkpoint is None else "from the checkpoint"
    step = rec.resume_step + 1
    if rec.replay is None or not rec.replay.kept:
        return f"all of step {step}"
    return f"{fraction:.0%} of step {step}: {len(rec.replay.missing)} of {rec.replay.total} microbatches"


def interrupted(g: int, rec: GenerationRecord) -> dict[str, Any]:
    """A generation that never committed a step: superseded during its reconfiguration."""
    return {**generation_fields(g, rec), "interrupted": True}


def generation_fields(g: int, rec: GenerationRecord) -> dict[str, Any]:
    """What every recovery entry says about the generation it recovered into."""
    return {
        "generation": g,
        "lost_nodes": rec.lost,
        "joined_nodes": rec.joined,
        "drained_nodes": rec.drained,
        "restore_checkpoint": rec.restore_checkpoint,
        "reason": rec.reason,
        "detected_at": rec.detected_at,
        "published_at": rec.published_at,
        "replayed_fraction": rec.replayed_fraction,
        "kept_microbatches": [] if rec.replay is None else rec.replay.kept,
        "recomputed": [] if rec.replay is None else rec.replay.recomputed,
    }


def recovery_breakdown(
    client: EtcdClient, rk: RunKeys, g: int, rec: GenerationRecord, timings: list[RecoveryTimings]
) -> dict[str, Any]:
    """One recovery's breakdown, reading the injections carried out from etcd (see `breakdown_of`)."""
    prefix = rk.injected("")
    carried_out = [(meta.key.decode()[len(prefix) :], float(value.decode()))
                   for value, meta in client.get_prefix(prefix)]
    return breakdown_of(g, rec, timings, carried_out)


def breakdown_of(
    g: int, rec: GenerationRecord, timings: list[RecoveryTimings], carried_out: list[tuple[str, float]]
) -> dict[str, Any]:
    """One recovery's breakdown from values already read: the generation record, every worker's
    timings and the injections carried out (request id, wall time). `total_s` runs from the
    injected fault (or the detection, when nothing was injected) to the first commit. A node's
    record beside its generation's summary is counted once (`distinct`)."""
    timings = distinct(timings)
    detected = rec.detected_at if rec.detected_at is not None else rec.published_at or 0.0
    faults = [t for node in rec.lost if (t := fault_time(carried_out, node, detected)) is not None]
    origin = min(faults) if faults else detected
    published = rec.published_at or detected
    synced = min(max(rec.synced_at or detected, detected), published)
    first_commit = max(t.first_commit_at for t in timings)
    started = max(t.started_at for t in timings)
    return {
        **generation_fields(g, rec),
        "detecting_s": max(0.0, detected - origin),
        "finishing_s": synced - detected,
        "planning_s": published - synced,
        "transferring_s": max(t.reconfig.transfer_s for t in timings),
        "rebuilding_s": max(t.reconfig.rebuild_s for t in timings),
        "replaying_s": max(0.0, first_commit - started),
        "total_s": max(0.0, first_commit - origin),
        "bytes_moved": sum(t.reconfig.bytes_fetched for t in timings),
        "bytes_moved_collective": sum(t.reconfig.bytes_collective for t in timings),
        "interrupted": False,
        "fault_at": origin,
        "first_commit_at": first_commit,
    }


FAULT_KINDS = ("kill", "hang", "slow", "partition")
"""Injection kinds that can make a node lost (drain and rejoin never do)."""


def fault_time(carried_out: list[tuple[str, float]], node: int, detected: float) -> float | None:
    """When the fault that lost `node` was injected: the latest injection of a fault kind into
    the node (request id `<kind>-node<N>-...`, carried out at the wall time given) at or before
    `detected`; None if there is none. A node failed and rejoined several times has several:
    the earlier ones belong to earlier recoveries, later ones to later ones."""
    times = [t for name, t in carried_out
             if t <= detected and any(name.startswith(f"{k}-node{node}-") for k in FAULT_KINDS)]
    return max(times, default=None)
