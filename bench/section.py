"""One part of `bench/run_all.py`'s report: its figures, the rows it could not measure, raw data."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from bench.stats import Figure

T = TypeVar("T")


@dataclass(kw_only=True)
class Section:
    """What one benchmark contributes to the table and the JSON."""

    title: str
    """Heading printed above its rows."""
    figures: list[Figure] = field(default_factory=list)
    """Measured quantities, one table row each."""
    not_run: list[str] = field(default_factory=list)
    """Rows that could not be measured here, each "name: not run: reason"."""
    notes: list[str] = field(default_factory=list)
    """Conditions a reader needs (model, batch, processes, trace)."""
    raw: list[dict[str, Any]] = field(default_factory=list)
    """Per-run details, written to the JSON only."""
    wall_s: float = 0.0
    """Seconds the section took."""

    def lines(self) -> list[str]:
        out = [f"== {self.title}  ({self.wall_s:.0f} s)"]
        out += [f"   note: {n}" for n in self.notes]
        out += [f"   {f.row()}" for f in self.figures]
        out += [f"   {r}" for r in self.not_run]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "figures": [f.to_dict() for f in self.figures], "not_run": self.not_run,
                "notes": self.notes, "raw": self.raw, "wall_s": self.wall_s}


def series(figures: dict[str, Figure], name: str, unit: str, value: float, note: str = "") -> None:
    """Append `value` to the figure called `name` in `figures`, creating it on first use."""
    if name not in figures:
        figures[name] = Figure(name=name, unit=unit, note=note)
    figures[name].samples.append(value)


def attempt(what: str, fn: Callable[[], T], section: Section, *, retries: int = 1) -> T | None:
    """`fn()`, re-run up to `retries` times if it raises (a false node loss under machine load is
    the usual cause); every failure is noted in `section`. None when every try failed."""
    for i in range(retries + 1):
        try:
            return fn()
        except Exception as exc:  # a failed run is reported as a row, not a crash of the whole table
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            why = f"{type(exc).__name__}: {first}"
            section.notes.append(f"{what}: try {i + 1} failed ({why})" + ("; re-run" if i < retries else ""))
            print(f"  {what}: try {i + 1} failed: {why}", file=sys.stderr, flush=True)
    return None


def exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit in the main thread, so that the runs' `finally` blocks stop
    every process they started (torchrun's workers live in sessions of their own)."""
    import signal

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
