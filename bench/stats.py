"""Summary statistics every benchmark reports: median of repeated runs, spread, a noise flag.

A figure is one `Figure`: the samples of one quantity over repeated runs. The table of
`bench/run_all.py` prints its median, its spread (min..max and the relative half-range), and
marks it noisy when the spread is large compared with the median.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

NOISY_SPREAD = 0.10
"""A figure whose (max - min) / 2 exceeds this fraction of its median is marked noisy."""


@dataclass(frozen=True, kw_only=True)
class Figure:
    """One measured quantity over repeated runs."""

    name: str
    """What was measured, e.g. "recovery tiny: this runtime"."""
    unit: str
    """Unit of the samples, e.g. "s", "steps", "ratio", "%"."""
    samples: list[float] = field(default_factory=list)
    """One value per run."""
    note: str = ""
    """Anything a reader must know to read the figure (baseline, conditions)."""

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")

    @property
    def spread(self) -> float:
        """Half the range over the median (0 with fewer than two samples)."""
        if len(self.samples) < 2 or self.median == 0:
            return 0.0
        return (max(self.samples) - min(self.samples)) / 2 / abs(self.median)

    @property
    def noisy(self) -> bool:
        return self.spread > NOISY_SPREAD

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "median": self.median, "spread": self.spread, "noisy": self.noisy,
                "min": min(self.samples, default=float("nan")), "max": max(self.samples, default=float("nan"))}

    def row(self) -> str:
        """One table line: name, median, range, spread and a noisy mark."""
        lo, hi = min(self.samples, default=float("nan")), max(self.samples, default=float("nan"))
        mark = "  NOISY" if self.noisy else ""
        return (f"{self.name:<52} {self.median:>10.4g} {self.unit:<6} [{lo:.4g} .. {hi:.4g}] "
                f"n={len(self.samples)} ±{self.spread * 100:.0f}%{mark}")
