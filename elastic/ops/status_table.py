"""`elastic status`'s table: a `JobStatus` (elastic/ops/status.py) as a few lines and two tables
for people (nodes, pipelines), then the latest recovery in words."""

from __future__ import annotations

import time
from typing import Any

from elastic.ops.status import JobStatus
from elastic.parallel.phase_clock import STEP_PHASES
from elastic.records.recoveries import change_words
from elastic.records.run_end import RunEnd


def _ago(t: float | None, now: float) -> str:
    return "-" if t is None else f"{now - t:.1f} s ago"


def _layers(layers: tuple[int, int] | list[int] | None) -> str:
    return "-" if layers is None else f"[{layers[0]},{layers[1]})"


def _recovery_line(r: dict[str, Any]) -> str:
    change = change_words(r["lost_nodes"], r["joined_nodes"], r.get("drained_nodes", []))
    head = f"generation {r['generation']} ({change})"
    if r["total_s"] is None:
        return f"{head}: in progress, no worker has reported yet"
    line = (
        f"{head}: total {r['total_s']:.2f} s = detect {r['detecting_s']:.2f} + finish {r['finishing_s']:.2f} "
        f"+ plan {r['planning_s']:.2f} "
        f"+ transfer {r['transferring_s']:.2f} + rebuild {r['rebuilding_s']:.2f} + replay {r['replaying_s']:.2f}; "
        f"{r['bytes_moved']} bytes moved"
    )
    if r.get("replayed_fraction") is not None:
        line += f"; replayed {r['replayed_fraction']:.0%} of the interrupted step"
    if r["restore_checkpoint"] is not None:
        line += f"; restored the checkpoint of step {r['restore_checkpoint']}"
    if not r["complete"]:
        line += f" (so far: {r['workers_reported']}/{r['workers_expected']} workers reported)"
    return line


def _ended_line(ended: dict[str, Any]) -> str:
    """The first line of an ended run's table: how it ended, and that what follows is its last status."""
    end = RunEnd.from_dict(ended)
    when = "" if end.at is None else time.strftime(" at %Y-%m-%d %H:%M:%S", time.localtime(end.at))
    return f"{end.describe()}{when}; its last status:"


def render_table(status: JobStatus) -> str:
    """The snapshot as a few lines and two tables, for people."""
    s = status
    total = "?" if s.total_steps is None else str(s.total_steps)
    lines = [
        f"job {s.job} at etcd {s.etcd}: {s.state}" + (f" ({s.fatal})" if s.fatal else "")
        + f", leader {s.leader or '-'}",
        f"generation {s.generation}" + (f" ({s.generation_reason}, from step {s.resume_step + 1})"
                                        if s.resume_step is not None else "")
        + f"; committed {s.committed_steps}/{total} steps"
        + (f", last loss {s.last_loss:.4f}" if s.last_loss is not None else ""),
    ]
    if s.ended is not None:
        lines.insert(0, _ended_line(s.ended))
    if s.suspicion is not None:
        v = s.suspicion
        lines.append(f"leases expired for nodes {v['suspects']}: answered the probe {v['answered']}, silent "
                     f"{v['silent']}{' (mass suspicion)' if v['mass'] else ''}: {v['decision']}; "
                     f"{v['cleared_total']} cleared by probe")
    if s.last_eval is not None:
        e = s.last_eval
        lines.append(f"validation loss {e['loss']:.4f} after step {e['step']} ({e['batches']} held-out batches, "
                     f"generation {e['generation']})")
    if s.checkpoint_failures is not None:
        c = s.checkpoint_failures
        lines.append(f"checkpoint saves failed: {c['count']}; last: step {c['last_step']} on node {c['last_node']} "
                     f"({_ago(c['last_at'], s.read_at)}): {c['last_reason']}")
    if s.spares:
        lines.append("hot spares: " + ", ".join(
            f"node {n.node} (incarnation {n.incarnation})" for n in s.nodes if n.role == "spare"))
    marked = [n for n in s.nodes if n.straggler is not None]
    if marked:
        lines.append("stragglers: " + ", ".join(
            f"node {n.node} ({n.straggler['factor']:.2f}x its peers, since step {n.straggler['since_step'] + 1})"
            for n in marked if n.straggler is not None))
    if s.throughput is not None:
        t = s.throughput
        lines.append(
            f"throughput {t.tokens_per_s:.0f} tokens/s over the last {t.window_steps} steps "
            f"(mean step {t.mean_step_s:.3f} s, last {t.last_step_s:.3f} s, {t.tokens_per_step} tokens/step)"
        )
    lines += ["", f"{'node':>4}  {'alive':<5}  {'inc':>3}  {'lease':>5}  {'address':<21}  {'pipe/stage':<10}  "
                  f"{'layers':<7}  {'speed':<6}  {'f/b/wait ms':<14}  {'workers (rank:pid@transfer)':<30}  failures"]
    for n in s.nodes:
        lease = "-" if n.lease_remaining_s is None else f"{n.lease_remaining_s}/{n.lease_granted_s}s"
        place = "-" if n.pipeline is None else f"{n.pipeline}/{n.stage}"
        workers = " ".join(f"{w.local_rank}:{w.pid}@{w.transfer_address}" for w in n.workers) or "-"
        fails = "; ".join(f"inc {f.incarnation} by {f.reporter}: {f.reason} ({_ago(f.time, s.read_at)})"
                          for f in n.failures) or "-"
        inc = "-" if n.incarnation is None else str(n.incarnation)
        speed = "-" if n.speed_factor is None else f"{n.speed_factor:.2f}" + ("!" if n.straggler else "")
        ph = n.step_phases
        phases = "-" if ph is None else "/".join(f"{ph[k] * 1e3:.0f}" for k in STEP_PHASES)
        lines.append(
            f"{n.node:>4}  {'yes' if n.alive else 'NO':<5}  {inc:>3}  {lease:>5}  {n.address or '-':<21}  "
            f"{place:<10}  {_layers(n.layers):<7}  {speed:<6}  {phases:<14}  {workers:<30}  {fails}"
        )
    if s.pipelines:
        lines += ["", f"{'pipe':>4}  {'template':>8}  {'mbs':>4}  stages (node:[layers))"]
        for p in s.pipelines:
            stages = " ".join(f"{st.node}:{_layers(st.layers)}" for st in p.stages)
            lines.append(f"{p.index:>4}  {p.template:>8}  {p.microbatches:>4}  {stages}")
    lines.append("")
    if s.last_recovery is None:
        lines.append("recoveries: none")
    else:
        lines.append(f"recoveries: {s.recoveries}; last: {_recovery_line(s.last_recovery)}")
    return "\n".join(lines)
