"""What the simulator is told: the job and cluster, and the costs of recovering from failures.

Every number here is an assumption of the simulation and is printed with its results.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from elastic.planning.cluster import DEFAULT_MEMORY_GIB, DEFAULT_TFLOPS, ClusterSpec

GBIT = 1e9 / 8
"""Bytes per second in one Gbit/s."""


@dataclass(frozen=True, kw_only=True)
class SimCluster:
    """The job and the cluster at time 0."""

    model: str
    """Model preset (elastic/model/config.py PRESETS)."""
    nodes: int
    """N: nodes live at time 0 (the trace's initial nodes)."""
    gpus_per_node: int = 1
    """G: devices per node, the tensor-parallel degree of every stage."""
    fault_tolerance: int = 1
    """f: the elastic policy keeps at least f+1 pipelines (relaxed towards 0 when it cannot)."""
    global_batch: int = 512
    """Samples per optimizer step."""
    microbatch: int = 1
    """Samples per microbatch."""
    device_tflops: float = DEFAULT_TFLOPS
    """Derived profiles: achieved TFLOP/s of one device."""
    device_memory_gib: float = DEFAULT_MEMORY_GIB
    """Derived profiles: memory budget of one device in GiB."""
    network_gbps: float = 100.0
    """Inter-node bandwidth of one node's NIC in Gbit/s: pipeline p2p and layer-shard transfers."""
    profile_path: str | None = None
    """A measured profile (`elastic profile`) instead of a derived one."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.network_gbps) and self.network_gbps > 0):
            raise ValueError(f"--network-gbps must be a positive number, got {self.network_gbps}")
        self.spec()  # validates the planner's part

    def spec(self) -> ClusterSpec:
        """The planner's view of this cluster (validates flags, names the known presets)."""
        return ClusterSpec(
            model=self.model,
            nodes=self.nodes,
            gpus_per_node=self.gpus_per_node,
            fault_tolerance=self.fault_tolerance,
            global_batch=self.global_batch,
            microbatch=self.microbatch,
            profile_path=self.profile_path,
            device_tflops=self.device_tflops,
            device_memory_gib=self.device_memory_gib,
        )

    @property
    def network_bytes_per_s(self) -> float:
        return self.network_gbps * GBIT

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
