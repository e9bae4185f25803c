"""The simulation report as a table, with the references and every assumption under it."""

from __future__ import annotations

from typing import Any

from elastic.model.config import GPTConfig, describe_model


def format_table(report: dict[str, Any]) -> str:
    c, refs = report["cluster"], report["references"]
    hours = report["horizon_s"] / 3600
    tr = report["trace"]
    model = c["model"] if not c.get("shape") else describe_model(c["model"], GPTConfig(**c["shape"]))
    lines = [
        f"model {model} on {c['nodes']} nodes x {c['gpus_per_node']} devices "
        f"({c['device_tflops']:g} TFLOP/s, {c['device_memory_gib']:g} GiB, {c['network_gbps']:g} Gbit/s), "
        f"f = {c['fault_tolerance']}, global batch {c['global_batch']} (microbatch {c['microbatch']})",
        f"profile: {report['profile']['source']}; checkpoint/replica state {report['profile']['model_bytes'] / 1e9:.2f} GB",
        f"trace: {tr['description']}: {tr['failures']} failures, {tr['joins']} joins in {hours:g} h",
        f"failure-free: {refs['failure_free_samples']} samples (initial plan {refs['initial_iteration_s']:.3f} s/step); "
        f"ideal: {refs['ideal_samples']} samples",
        *([f"hot spares (elastic policy): {report['spares']} beside the {c['nodes']} nodes"]
          if report.get("spares") else []),
        "",
        f"{'policy':<19} {'effective':>9} {'vs ideal':>8} {'samples':>10} {'recovery s':>10} "
        f"{'ckpt s':>8} {'lost s':>8} {'reconf':>6} {'restarts':>8}  note",
    ]
    for p in report["policies"]:
        note = p["infeasible"] or (f"stalled at {p['stalled_at']:.0f} s" if p["stalled_at"] is not None else "")
        if p.get("spares_taken"):
            note = f"{note}; " * bool(note) + f"{p['spares_taken']} spare(s) taken in"
        lines.append(
            f"{p['policy']:<19} {p['effective']:>9.1%} {p['vs_ideal']:>8.1%} {p['samples']:>10} "
            f"{p['recovery_s']:>10.1f} {p['checkpoint_s']:>8.1f} {p['lost_s']:>8.1f} "
            f"{p['reconfigurations']:>6} {p['restarts']:>8}  {note}"
        )
    lines += [
        "",
        "effective = samples / failure-free samples of the initial plan over the whole time;",
        "vs ideal  = samples / samples of the fastest plan for the live node count at every moment, switched for free.",
        "",
        "assumptions:",
    ]
    for p in report["policies"]:
        lines.append(f"  {p['policy']}:")
        lines += [f"    - {a}" for a in p["assumptions"]]
    return "\n".join(lines)
