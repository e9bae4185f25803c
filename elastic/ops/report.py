"""The run report: a PNG timeline of a finished run, and a paragraph saying what happened.

`write_report(run_dir)` reads `<run_dir>/summary.json` (a RunSummary) and draws
`<run_dir>/report.png`, 1200 x 800 pixels, two panels over wall time since the launcher
started: the loss of each committed step, and each step's throughput (tokens of the global batch
over the step's seconds); a run with `--eval-every` adds its validation losses to the loss panel
(squares at the commit of the step each followed). On both panels a red line marks each injected fault or lost node
("node 2 lost"), a shaded span covers each recovery (fault to the first commit after it), a
dotted line marks each new generation, and a green line each node that joined. An orange span
covers each time a node was marked as a straggler (`straggler` to `straggler-cleared`, or the
run's end), from the history `elastic run` saved in `<run_dir>/history/events.json`.

An elastic run's summary carries wall times (`started_at`, `step_committed_at`, per recovery
`fault_at` ... `first_commit_at`); a static run's does not, so its steps are laid end to end by
their durations and nothing else is marked. `summary_text` is the paragraph `elastic report`
prints. Matplotlib is imported inside `write_report`: it takes a second or two.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.png"
FIGSIZE = (12.0, 8.0)
DPI = 100
"""The PNG is FIGSIZE x DPI pixels: 1200 x 800."""


class ReportError(ValueError):
    """The run directory or its summary.json cannot be reported on; the message says why."""


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """A run's summary reduced to what the report draws and says."""

    times: list[float]
    """Seconds since the start at which each committed step ended."""
    losses: list[float]
    """Loss of each committed step."""
    throughput: list[float]
    """Tokens per second of each committed step (global batch x seq_len / step seconds)."""
    generations: list[int]
    """Generation that committed each step (empty for a static run)."""
    recoveries: list[dict[str, Any]]
    """The summary's recovery entries, unchanged."""
    origin: float
    """Wall time (Unix seconds) that `times` count from (0.0 for a static run)."""
    tokens_per_s: float
    """The summary's tokens/s over the whole run."""
    steady_step_s: float
    """The summary's median step time."""
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    """(steps committed, validation loss) of each evaluation (`--eval-every`), by step."""
    slow_spans: list[tuple[float, float, int]] = field(default_factory=list)
    """(start, end, node) in seconds since the start: each time a node was marked as a straggler."""


def _number_list(data: dict[str, Any], key: str) -> list[float]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(
        isinstance(x, int | float) and not isinstance(x, bool) for x in value
    ):
        raise ReportError(f"{SUMMARY_FILE}: {key!r} must be a list of numbers")
    return [float(x) for x in value]


def _number(data: dict[str, Any], key: str, default: float | None = None) -> float:
    value = data.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ReportError(f"{SUMMARY_FILE}: {key!r} must be a number, got {value!r}")
    return float(value)


def load_timeline(run_dir: Path) -> Timeline:
    """Read and check `<run_dir>/summary.json`; ReportError naming what is missing or malformed."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"run directory {run_dir} does not exist")
    path = run_dir / SUMMARY_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ReportError(f"{path} not found (an `elastic run` writes it when the run ends)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path} must hold a JSON object (a run summary)")
    for key in ("steps_committed", "losses", "step_seconds", "global_batch", "seq_len"):
        if key not in data:
            raise ReportError(f"{path} has no {key!r}: not a run summary")
    losses = _number_list(data, "losses")
    seconds = _number_list(data, "step_seconds")
    committed_at = _number_list(data, "step_committed_at")
    generations = [int(g) for g in _number_list(data, "step_generations")]
    if len(seconds) != len(losses) or int(_number(data, "steps_committed")) != len(losses):
        raise ReportError(f"{path}: steps_committed, losses and step_seconds disagree on the step count")
    recoveries = data.get("recoveries", [])
    if not isinstance(recoveries, list) or not all(isinstance(r, dict) for r in recoveries):
        raise ReportError(f"{path}: 'recoveries' must be a list of objects")
    tokens = _number(data, "global_batch") * _number(data, "seq_len")
    started_at = _number(data, "started_at", 0.0)
    if committed_at and len(committed_at) == len(losses) and started_at > 0:
        origin, times = started_at, [t - started_at for t in committed_at]
    else:  # a static run: steps end to end
        origin, times = 0.0, [sum(seconds[: i + 1]) for i in range(len(seconds))]
        generations, recoveries = [], []
    return Timeline(
        eval_losses=_eval_losses(data, len(losses), path),
        times=times,
        losses=losses,
        throughput=[tokens / s if s > 0 else math.nan for s in seconds],
        generations=generations if len(generations) == len(losses) else [],
        recoveries=recoveries,
        origin=origin,
        tokens_per_s=_number(data, "tokens_per_s", 0.0),
        steady_step_s=_number(data, "steady_step_s", 0.0),
        slow_spans=straggler_spans(_history_events(run_dir), origin, times[-1] if times and origin else 0.0),
    )


def _history_events(run_dir: Path) -> list[dict[str, Any]]:
    """The events of `<run_dir>/history/events.json` (elastic/ops/run_history.py); none when it
    is missing or unreadable (the report draws without them)."""
    try:
        events = json.loads((run_dir / "history" / "events.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return []
    return [e for e in events if isinstance(e, dict)] if isinstance(events, list) else []


def straggler_spans(events: list[dict[str, Any]], origin: float, end: float) -> list[tuple[float, float, int]]:
    """(start, end, node) of each straggler mark in `events`, in seconds since `origin`: from a
    `straggler` event to the node's next `straggler-cleared`, or `end`. Marks outside [0, end]
    (another run's history) are left out."""
    spans: list[tuple[float, float, int]] = []
    open_at: dict[int, float] = {}
    marks = sorted([(float(e["time"]) - origin, e["detail"]["node"], e.get("kind")) for e in events
                    if isinstance(e.get("time"), int | float) and isinstance(e.get("detail"), dict)
                    and isinstance(e["detail"].get("node"), int)], key=lambda m: (m[0], m[1]))
    for at, node, kind in marks:
        if kind == "straggler" and node not in open_at:
            open_at[node] = at
        elif kind == "straggler-cleared" and node in open_at:
            spans.append((open_at.pop(node), at, node))
    spans += [(at, end, node) for node, at in open_at.items()]
    return sorted((max(a, 0.0), min(b, end), n) for a, b, n in spans if end > 0 and b > 0 and a < end and b > a)


def _eval_losses(data: dict[str, Any], steps: int, path: Path) -> list[tuple[int, float]]:
    """The summary's `eval_losses` ([[step, loss], ...], step in [1, steps]), checked."""
    value = data.get("eval_losses", [])
    ok = isinstance(value, list) and all(
        isinstance(e, list) and len(e) == 2 and all(isinstance(x, int | float) and not isinstance(x, bool) for x in e)
        and 1 <= e[0] <= steps for e in value
    )
    if not ok:
        raise ReportError(f"{path}: 'eval_losses' must be a list of [step, loss] with steps of committed steps")
    return [(int(step), float(loss)) for step, loss in value]


def _nodes(nodes: list[int]) -> str:
    return ("node " if len(nodes) == 1 else "nodes ") + ", ".join(str(n) for n in nodes)


def event_label(rec: dict[str, Any]) -> str:
    """How the timeline names a recovery: "node 2 lost", "node 2 joined", "nodes 1, 3 lost", "node 1 drained"."""
    parts = []
    if rec.get("lost_nodes"):
        parts.append(f"{_nodes(rec['lost_nodes'])} lost")
    if rec.get("joined_nodes"):
        parts.append(f"{_nodes(rec['joined_nodes'])} joined")
    if rec.get("drained_nodes"):
        parts.append(f"{_nodes(rec['drained_nodes'])} drained")
    return ", ".join(parts) or str(rec.get("reason", "reconfigured"))


def summary_text(run_dir: Path) -> str:
    """One paragraph: steps, final loss, throughput, and the recoveries with their totals."""
    t = load_timeline(run_dir)
    if not t.losses:
        return "No step was committed."
    text = (
        f"{len(t.losses)} steps committed in {t.times[-1]:.1f} s, final loss {t.losses[-1]:.4f} "
        f"(first {t.losses[0]:.4f}), {t.tokens_per_s:.0f} tokens/s, median step {t.steady_step_s * 1000:.0f} ms."
    )
    if t.eval_losses:
        step, loss = t.eval_losses[-1]
        text += f" Validation loss {loss:.4f} after step {step} ({len(t.eval_losses)} evaluations)."
    finished = [r for r in t.recoveries if not r.get("interrupted")]
    interrupted = len(t.recoveries) - len(finished)
    if not t.recoveries:
        return text + " No failures or recoveries."
    word = "recovery" if len(t.recoveries) == 1 else "recoveries"
    each = "; ".join(
        f"generation {r['generation']} ({event_label(r)}): {float(r.get('total_s', 0.0)):.2f} s, "
        f"{int(r.get('bytes_moved', 0))} bytes moved"
        + (
            f", restored the checkpoint of step {r['restore_checkpoint']}"
            if r.get("restore_checkpoint") is not None
            else ""
        )
        for r in finished
    )
    total_s = sum(float(r.get("total_s", 0.0)) for r in finished)
    total_bytes = sum(int(r.get("bytes_moved", 0)) for r in finished)
    text += f" {len(t.recoveries)} {word}, {total_s:.2f} s and {total_bytes} bytes in all: {each}."
    if interrupted:
        text += f" {interrupted} reconfiguration(s) superseded by a further failure before training."
    return text


def write_report(run_dir: Path) -> Path:
    """Draw `<run_dir>/report.png` from `<run_dir>/summary.json` (module doc) and return its path."""
    t = load_timeline(run_dir)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tput) = plt.subplots(2, 1, sharex=True, figsize=FIGSIZE, dpi=DPI)
    try:
        for lo, hi in _segments(t.generations, len(t.times)):  # no line across a reconfiguration
            ax_loss.plot(t.times[lo:hi], t.losses[lo:hi], marker="o", markersize=3, color="tab:blue")
            ax_tput.plot(t.times[lo:hi], t.throughput[lo:hi], marker="o", markersize=3, color="tab:orange")
        if t.eval_losses:
            ax_loss.plot([t.times[step - 1] for step, _ in t.eval_losses], [loss for _, loss in t.eval_losses],
                         marker="s", markersize=5, color="tab:green", label="validation loss (held-out)")
        ax_loss.set_ylabel("loss")
        ax_tput.set_ylabel("tokens/s (per step)")
        ax_tput.set_xlabel("seconds since start" if t.origin else "seconds of training (static run)")
        _mark_recoveries(t, (ax_loss, ax_tput))
        _mark_stragglers(t, (ax_loss, ax_tput))
        title = f"{len(t.losses)} steps, final loss {t.losses[-1]:.4f}" if t.losses else "no step committed"
        if t.origin and t.times:
            title += f" (first commit {t.times[0]:.1f} s after the start)"
        ax_loss.set_title(title)
        for ax in (ax_loss, ax_tput):
            ax.grid(alpha=0.3)
        if ax_loss.get_legend_handles_labels()[0]:
            ax_loss.legend(loc="upper right", fontsize="small")
        fig.tight_layout()
        out = Path(run_dir) / REPORT_FILE
        fig.savefig(out, dpi=DPI)
    finally:
        plt.close(fig)
    return out


def _segments(generations: list[int], n: int) -> list[tuple[int, int]]:
    """[lo, hi) index ranges of consecutive steps committed by the same generation."""
    if not generations:
        return [(0, n)]
    cuts = [i for i in range(1, n) if generations[i] != generations[i - 1]]
    bounds = [0, *cuts, n]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _mark_recoveries(t: Timeline, axes: tuple[Any, ...]) -> None:
    def at(wall: Any) -> float | None:
        return float(wall) - t.origin if isinstance(wall, int | float) and wall else None

    for rec in t.recoveries:
        fault, done = at(rec.get("fault_at")), at(rec.get("first_commit_at"))
        published = at(rec.get("published_at"))
        lost = bool(rec.get("lost_nodes"))
        for i, ax in enumerate(axes):
            first = i == 0  # label once, on the top panel (its legend)
            if fault is not None:
                ax.axvline(fault, color="tab:red" if lost else "tab:green", linewidth=1.5,
                           label=event_label(rec) if first else None)
                if done is not None and done > fault:
                    ax.axvspan(fault, done, color="tab:red", alpha=0.12,
                               label=f"recovery into generation {rec['generation']}" if first else None)
            if published is not None:
                ax.axvline(published, color="tab:gray", linestyle=":", linewidth=1.2,
                           label=f"generation {rec['generation']}" + (" (superseded)" if rec.get("interrupted") else "")
                           if first else None)


def _mark_stragglers(t: Timeline, axes: tuple[Any, ...]) -> None:
    labelled: set[int] = set()
    for start, end, node in t.slow_spans:
        for i, ax in enumerate(axes):
            first = i == 0 and node not in labelled
            ax.axvspan(start, end, color="tab:orange", alpha=0.15, label=f"node {node} marked slow" if first else None)
        labelled.add(node)
