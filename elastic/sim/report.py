"""The simulation report as a table, with the references and every assumption under it."""

from __future__ import annotations

from typing import Any

from elastic.model.config import GPTConfig, describe_model


def format_table(report: dict[str, Any]) -> str:
    c, refs = report["cluster"], report["references"]
    width = max(19, *(len(p["policy"]) for p in report["policies"]))
    hours = report["horizon_s"] / 3600
    tr = report["trace"]
    model = c["model"] if not c.get("shape") else describe_model(c["model"], GPTConfig(**c["shape"]))
    lines = [
        f"model {model} on {c['nodes']} nodes x {c['gpus_per_node']} devices "
        f"({c['device_tflops']:g} TFLOP/s, {c['device_memory_gib']:g} GiB, {c['network_gbps']:g} Gbit/s), "
        f"f = {c['fault_tolerance']}, global batch {c['global_batch']} (microbatch {c['microbatch']})",
        f"profile: {report['profile']['source']}; checkpoint/replica state {report['profile']['model_bytes'] / 1e9:.2f} GB",
        f"trace: {tr['description']}: {tr['failures']} failures, {tr['joins']} joins"
        + (f", {tr['slowdowns']} slowdowns" if tr.get("slowdowns") else "") + f" in {hours:g} h",
        f"failure-free: {refs['failure_free_samples']} samples (initial plan {refs['initial_iteration_s']:.3f} s/step); "
        f"ideal: {refs['ideal_samples']} samples",
        *([f"failures by cause: {', '.join(f'{k} {v}' for k, v in tr['causes'].items())}"] if tr.get("causes") else []),
        *([f"hot spares (elastic policy): {report['spares']} beside the {c['nodes']} nodes"]
          if report.get("spares") else []),
        *[f"slow nodes: {note}" for note in report.get("stragglers", {}).get("notes", [])],
        "",
        f"{'policy':<{width}} {'effective':>9} {'eff. h':>8} {'vs ideal':>8} {'samples':>14} {'recovery s':>10} "
        f"{'ckpt s':>8} {'lost s':>8} {'reconf':>6} {'restarts':>8}  note",
    ]
    for p in report["policies"]:
        lines.append(
            f"{p['policy']:<{width}} {p['effective']:>9.1%} {p['effective'] * hours:>8.1f} {p['vs_ideal']:>8.1%} "
            f"{p['samples']:>14} "
            f"{p['recovery_s']:>10.1f} {p['checkpoint_s']:>8.1f} {p['lost_s']:>8.1f} "
            f"{p['reconfigurations']:>6} {p['restarts']:>8}  {_note(p)}"
        )
    lines += _copies_lines(report, hours)
    lines += [
        "",
        "effective = samples / failure-free samples of the initial plan over the whole time;",
        "eff. h    = effective training time: effective x the simulated hours;",
        "vs ideal  = samples / samples of the fastest plan for the live node count at every moment, switched for free.",
        "",
        "assumptions:",
    ]
    for p in report["policies"]:
        lines.append(f"  {p['policy']}:")
        lines += [f"    - {a}" for a in p["assumptions"]]
    return "\n".join(lines)


def _copies_lines(report: dict[str, Any], hours: float) -> list[str]:
    """The elastic policy's last-copy losses, full replicas beside sharded optimizer slices
    (elastic/sim/copies.py), with the losses expected at the trace's per-node failure rate."""
    rate = report["trace"]["failures"] / max(1e-9, hours * 3600 * report["cluster"]["nodes"])  # per node-second
    out = []
    for p in report["policies"]:
        c = p.get("copies")
        if c is None:
            continue
        out.append(
            f"last copies ({p['policy']}): every holder of a layer lost {c['layers_lost']} time(s) with full replicas "
            f"(exposed {c['layer_exposure_node_s'] / 3600:.3g} node-h, expected {c['layer_exposure_node_s'] * rate:.3g}); "
            f"every owner of an optimizer slice {c['slices_lost']} time(s) if sharded with f+1 owners "
            f"(exposed {c['slice_exposure_node_s'] / 3600:.3g} node-h, expected {c['slice_exposure_node_s'] * rate:.3g}): "
            "each would be a checkpoint fallback")
    return out


def _note(p: dict[str, Any]) -> str:
    """A policy row's note: why it could not run or stalled, the spares it took, its straggler actions."""
    notes = [p["infeasible"] or (f"stalled at {p['stalled_at']:.0f} s" if p["stalled_at"] is not None else "")]
    if p.get("spares_taken"):
        notes.append(f"{p['spares_taken']} spare(s) taken in")
    if p.get("resplits"):
        notes.append(f"{p['resplits']} re-split(s)")
    if p.get("slow_swaps"):
        notes.append(f"{p['slow_swaps']} slow node(s) swapped for a spare")
    return "; ".join(n for n in notes if n)
