"""What the simulator is told besides the job and cluster (`elastic.planning.cluster.ClusterSpec`,
the same type a run plans with): the costs of recovering from failures.

Every number here is an assumption of the simulation and is printed with its results.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from elastic.planning.cluster import GBIT


@dataclass(frozen=True, kw_only=True)
class RecoveryCosts:
    """Seconds and rates the policies pay when the membership changes."""

    detect_s: float = 3.0
    """Failure detection: the etcd lease TTL (`elastic run --lease-ttl`, default 3 s) for a node that
    dies silently; also what the redundant policy pays to notice a failure."""
    rebuild_s: float = 5.0
    """Rebuilding process groups and stage modules after a re-plan (elastic and redundant policies).
    Assumed: bench/README's CPU recovery measured 0.4-16 s, dominated by re-initialising stages."""
    replan_s: float | None = None
    """Planning time charged per re-plan; None measures the real planner call (wall clock)."""
    process_start_s: float = 30.0
    """Checkpoint-restart: relaunching every process, rendezvous and group setup, before loading."""
    storage_gbps: float = 8.0
    """Checkpoint-restart: aggregate bandwidth to/from checkpoint storage in Gbit/s (8 = 1 GB/s)."""
    checkpoint_interval_s: float | None = None
    """Checkpoint-restart: seconds of training between checkpoints; None uses Young's optimum
    sqrt(2 x write time x mean time between failures of the trace)."""
    redundant_forward: float = 1.0
    """Redundant policy: fraction of the successor's forward compute NOT hidden in pipeline
    bubbles (1.0 = none hidden, the upper bound; 0.0 = all hidden, Bamboo's best case)."""

    def __post_init__(self) -> None:
        for name in ("detect_s", "rebuild_s", "process_start_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {value}")
        if self.replan_s is not None and not (math.isfinite(self.replan_s) and self.replan_s >= 0):
            raise ValueError(f"replan_s must be a number >= 0, got {self.replan_s}")
        if not (math.isfinite(self.storage_gbps) and self.storage_gbps > 0):
            raise ValueError(f"--storage-gbps must be a positive number, got {self.storage_gbps}")
        interval = self.checkpoint_interval_s
        if interval is not None and not (math.isfinite(interval) and interval > 0):
            raise ValueError(f"--checkpoint-interval must be a positive number, got {interval}")
        if not 0.0 <= self.redundant_forward <= 1.0:
            raise ValueError(f"--redundant-forward must be in [0, 1], got {self.redundant_forward}")

    @property
    def storage_bytes_per_s(self) -> float:
        return self.storage_gbps * GBIT

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
