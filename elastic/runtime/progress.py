"""What the launcher reads of an elastic run from etcd: committed steps, generations,
recoveries (with their breakdown) and worker PIDs, and the run summary built from them."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic.coordinator.keys import JobKeys
from elastic.runtime.protocol import (
    ElasticConfig,
    GenerationRecord,
    RecoveryTimings,
    RunKeys,
    StepResult,
    WorkerInfo,
)
from elastic.runtime.summary import RunSummary


@dataclass
class Progress:
    """What the launcher has seen of an elastic run so far (read from etcd each poll)."""

    results: dict[int, Any] = field(default_factory=dict)
    printed: set[tuple[int, int]] = field(default_factory=set)
    generations: dict[int, Any] = field(default_factory=dict)
    reported: set[int] = field(default_factory=set)
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    pids: dict[tuple[int, int, int], set[int]] = field(default_factory=dict)
    rejoined: set[str] = field(default_factory=set)


def run_finished(client: Any, rk: RunKeys, progress: Progress, steps: int) -> bool:
    if len(progress.results) < steps or not progress.generations:
        return False
    last = progress.generations[max(progress.generations)]
    done = {(int(m.key.decode().split("/")[-2]), int(m.key.decode().split("/")[-1]))
            for _, m in client.get_prefix(rk.done, keys_only=True)}  # fmt: skip
    return all((n, r) in done for n in last.plan.nodes for r in range(last.plan.gpus_per_node))


def poll_progress(
    client: Any, keys: JobKeys, config: ElasticConfig, progress: Progress, say: Callable[[str], None]
) -> None:
    rk = RunKeys(keys)
    spec = config.spec
    for value, meta in client.get_prefix(rk.workers):
        node, local_rank = (int(x) for x in meta.key.decode().split("/")[-2:])
        info = WorkerInfo.from_json(value)
        progress.pids.setdefault((node, local_rank, info.incarnation), set()).add(info.pid)
    for value, meta in client.get_prefix(keys.plans):
        g = int(meta.key.decode().rsplit("/", 1)[1])
        if g not in progress.generations:
            progress.generations[g] = GenerationRecord.from_json(value)
            rec = progress.generations[g]
            if g > 1:
                say(f"elastic run: generation {g}: {rec.reason} (resume at step {rec.resume_step + 1})")
    for value, _ in client.get_prefix(rk.results):
        r = StepResult.from_json(value)
        progress.results[r.step] = r
        if (r.step, r.generation) not in progress.printed:
            progress.printed.add((r.step, r.generation))
            tokens = spec.plan.global_batch * spec.model_config.seq_len
            say(f"step {r.step + 1}/{spec.steps}  loss {r.loss:.4f}  grad_norm {r.grad_norm:.3f}  lr {r.lr:.2e}  "
                f"{r.seconds * 1000:.0f} ms  {tokens / max(r.seconds, 1e-9):.0f} tok/s  (generation {r.generation})")  # fmt: skip
    for g, rec in sorted(progress.generations.items()):
        if g == 1 or g in progress.reported:
            continue
        world = len(rec.plan.nodes) * rec.plan.gpus_per_node
        timings = [RecoveryTimings.from_json(v) for v, _ in client.get_prefix(f"{rk.recoveries}{g}/")]
        superseded = any(later > g for later in progress.generations)
        trained = any(r.generation == g for r in progress.results.values())
        if len(timings) < world and not (superseded and (not trained or timings)):
            continue
        progress.reported.add(g)
        if not timings:  # a further failure cut this reconfiguration short
            say(
                f"elastic run: generation {g} ({change_words(rec.lost, rec.joined, rec.drained)}) was superseded before it trained"
            )
            progress.recoveries.append(interrupted(g, rec))
            continue
        recovery = recovery_breakdown(client, rk, g, rec, timings)
        progress.recoveries.append(recovery)
        say(
            f"elastic run: recovered into generation {g} ({change_words(rec.lost, rec.joined, rec.drained)}) in "
            f"{recovery['total_s']:.2f} s: detect {recovery['detecting_s']:.2f} s, plan {recovery['planning_s']:.2f} s, "
            f"transfer {recovery['transferring_s']:.2f} s, rebuild groups {recovery['rebuilding_s']:.2f} s, "
            f"replay {recovery['replaying_s']:.2f} s, {recovery['bytes_moved']} bytes moved"
            + (
                f", restored checkpoint of step {rec.restore_checkpoint}"
                if rec.restore_checkpoint is not None
                else ""
            )
        )


def change_words(lost: list[int], joined: list[int], drained: list[int]) -> str:
    """A generation's change of membership in words, e.g. "lost [2], joined [4]" or "drained [1]"."""
    parts = [f"{what} {nodes}" for what, nodes in (("lost", lost), ("joined", joined), ("drained", drained)) if nodes]
    return ", ".join(parts) or "no change of nodes"


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
    }


def recovery_breakdown(
    client: Any, rk: RunKeys, g: int, rec: GenerationRecord, timings: list[RecoveryTimings]
) -> dict[str, Any]:
    """One recovery's breakdown, reading the injections carried out from etcd (see `breakdown_of`)."""
    prefix = rk.injected("")
    carried_out = [(meta.key.decode()[len(prefix) :], float(value.decode()))
                   for value, meta in client.get_prefix(prefix)]  # fmt: skip
    return breakdown_of(g, rec, timings, carried_out)


def breakdown_of(
    g: int, rec: GenerationRecord, timings: list[RecoveryTimings], carried_out: list[tuple[str, float]]
) -> dict[str, Any]:
    """One recovery's breakdown from values already read: the generation record, every worker's
    timings and the injections carried out (request id, wall time). `total_s` runs from the
    injected fault (or the detection, when nothing was injected) to the first commit."""
    detected = rec.detected_at if rec.detected_at is not None else rec.published_at or 0.0
    faults = [t for node in rec.lost if (t := fault_time(carried_out, node, detected)) is not None]
    origin = min(faults) if faults else detected
    published = rec.published_at or detected
    first_commit = max(t.first_commit_at for t in timings)
    started = max(t.started_at for t in timings)
    return {
        **generation_fields(g, rec),
        "detecting_s": max(0.0, detected - origin),
        "planning_s": max(0.0, published - detected),
        "transferring_s": max(t.transfer_s for t in timings),
        "rebuilding_s": max(t.rebuild_s for t in timings),
        "replaying_s": max(0.0, first_commit - started),
        "total_s": max(0.0, first_commit - origin),
        "bytes_moved": sum(t.bytes_fetched for t in timings),
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
             if t <= detected and any(name.startswith(f"{k}-node{node}-") for k in FAULT_KINDS)]  # fmt: skip
    return max(times, default=None)


def elastic_summary(config: ElasticConfig, progress: Progress, *, started_at: float) -> RunSummary:
    spec = config.spec
    results = [progress.results[s] for s in sorted(progress.results)]
    restarts = sum(len(pids) - 1 for pids in progress.pids.values())
    tokens = spec.plan.global_batch * spec.model_config.seq_len
    seconds = [r.seconds for r in results]
    steady = seconds[1:] or seconds
    last = progress.generations[max(progress.generations)]
    wall = (results[-1].committed_at - results[0].committed_at + seconds[0]) if results else 0.0
    return RunSummary(
        steps_committed=len(results),
        losses=[r.loss for r in results],
        tokens_per_s=tokens * len(results) / wall if wall > 0 else 0.0,
        steady_step_s=statistics.median(steady) if steady else 0.0,
        step_seconds=seconds,
        grad_norms=[r.grad_norm for r in results],
        step_committed_at=[r.committed_at for r in results],
        step_generations=[r.generation for r in results],
        started_at=started_at,
        global_batch=spec.plan.global_batch,
        seq_len=spec.model_config.seq_len,
        world_size=len(last.plan.nodes) * last.plan.gpus_per_node,
        pipelines=len(last.plan.pipelines),
        recoveries=progress.recoveries,
        worker_restarts=restarts,
        startup_s=(results[0].committed_at - started_at) if results else 0.0,
        worker_pids={f"{n}/{r}/{i}": sorted(p) for (n, r, i), p in sorted(progress.pids.items())},
    )
