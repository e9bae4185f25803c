"""Where a worker's reconfiguration into a generation spent its time: `ReconfigTimings` (what
`Trainer.start` measured) inside `RecoveryTimings` (at `recoveries/<g>/<rank>`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.coordinator.jsonrecord import INLINE, JsonRecord


@dataclass(frozen=True, kw_only=True)
class ReconfigTimings:
    """Where the time of one worker's joining a generation went (what `Trainer.start` measured)."""

    transfer_s: float
    """Seconds spent getting the missing shards (over the generation's process group, then from
    their holders) and the kept gradient sums that move with a layer."""
    rebuild_s: float
    """Seconds spent building the process groups, the stage module, its optimizer state and its
    gradient buffers (the recovery breakdown's `rebuilding_s`, the slowest worker's)."""
    bytes_fetched: int
    """Bytes of fetched tensors (parameters and optimizer moments)."""
    bytes_collective: int = 0
    """The part of `bytes_fetched` that came over the generation's process group."""


@dataclass(frozen=True, kw_only=True)
class RecoveryTimings(JsonRecord):
    """One worker's reconfiguration into a generation, at `recoveries/<g>/<rank>`.

    Its JSON is one flat object (`reconfig`'s fields beside the others), the form that
    `elastic status`, `elastic events`, the metrics and the launcher have always read."""

    seen_at: float
    """Wall time the worker learned of the generation."""
    reconfig: ReconfigTimings = field(metadata=INLINE)
    """What joining the generation cost (transfer, rebuild, bytes)."""
    started_at: float
    """Wall time `Trainer.start` returned."""
    first_commit_at: float
    """Wall time of its first commit in the generation."""
