"""What the simulator is told besides the job and cluster (`elastic.planning.cluster.ClusterSpec`,
the same type a run plans with): the costs of recovering from failures, and of reacting to a
slow node (the runtime's straggler policy, elastic/planning/stragglers.py).

Every number here is printed with the results: a measured figure names its source (a section of
bench/README.md), anything else is an assumption of the simulation.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from elastic.planning.cluster import GBIT, ClusterSpec
from elastic.planning.stragglers import StragglerConfig
from elastic.sim.llama3_trace import effect_of

_RUNTIME = StragglerConfig()
"""The runtime's straggler defaults (`elastic run --straggler-*`), which the straggler fields follow."""


@dataclass(frozen=True, kw_only=True)
class RecoveryCosts:
    """Seconds and rates the policies pay when the membership changes."""

    detect_s: float = 3.0
    """Failure detection of a lost host: the etcd lease TTL (`elastic run --lease-ttl`, default 3 s).
    Measured: bench/README.md "Failure detection", an agent SIGKILLed is seen on lease expiry,
    median 2.14 s at a 2 s TTL (about the TTL). Used for a failure with no cause or a `node` one."""
    detect_process_s: float = 0.0053
    """Failure detection when only the node's processes die (a Llama 3 `process` cause: software
    bug, NCCL watchdog, dependency; elastic/sim/llama3_trace.py): the node's pidfd monitor revokes
    its lease. Measured: bench/README.md "Failure detection", worker SIGKILL, median 5.3 ms."""
    rebuild_s: float = 0.75
    """Rebuilding process groups and stage modules after a change (every policy but
    checkpoint-restart). Measured: bench/README.md "Recovery that loses less than a step", rebuild
    (groups + stage, the slowest worker) 0.03-0.18 s (small) and 0.24-0.75 s (gpt2-124m); the
    largest is used. 4 nodes on CPU with gloo: NCCL communicators over thousands of GPUs take
    longer, so this is a lower bound (`--rebuild-s`)."""
    transfer_gbps: float | None = 10.6
    """Shard transfer rate per node in Gbit/s, capped by the NIC (`network_gbps`); None: the NIC.
    Measured: bench/README.md "Recovery that loses less than a step", 1.15 GB moved in 0.80-0.87 s
    by the collective path during a recovery (1.32 GB/s at the slowest = 10.6 Gbit/s; the same path
    alone ran at 2.54 GB/s). CPU and gloo: on GPUs the NIC may bound it instead (`--transfer-gbps`)."""
    partial_replay: bool = True
    """Elastic: partial replay (elastic/records/partial.py): a failure keeps the microbatches of
    the pipelines that lost no node and recomputes only the lost ones; False replays the whole
    interrupted step (the runtime before issue 14; `--whole-step-replay`)."""
    finish_from: float = 1 / 3
    """Elastic, partial replay: a failure this far (a fraction) into a step or later lets the intact
    pipelines finish their microbatches; earlier, every pipeline stops and the whole step is
    replayed (elastic/records/partial.py FINISH_FROM)."""
    replan_s: float | None = None
    """Planning time charged per re-plan; None measures the real planner call (wall clock)."""
    process_start_s: float = 30.0
    """Checkpoint-restart: relaunching every process, rendezvous and group setup, before loading."""
    storage_gbps: float = 8.0
    """Checkpoint-restart: aggregate bandwidth to/from checkpoint storage in Gbit/s (8 = 1 GB/s)."""
    checkpoint_interval_s: float | None = None
    """Checkpoint-restart: seconds of training between checkpoints; None uses Young's optimum
    sqrt(2 x write time x mean time between failures of the trace)."""
    recycle_hidden: float = 0.0
    """ReCycle policy: share of the rerouted microbatches' work placed in the receiving stage's
    pipeline bubbles, never more than that stage's idle time in the failure-free 1F1B step
    (0.0 = none hidden, every rerouted microbatch lengthens its stage: the upper bound, as
    `redundant_forward` = 1; 1.0 = ReCycle's aim, bounded by the bubbles; `--recycle-hidden`)."""
    redundant_forward: float = 1.0
    """Redundant policy: fraction of the successor's forward compute NOT hidden in pipeline
    bubbles (1.0 = none hidden, the upper bound; 0.0 = all hidden, Bamboo's best case)."""
    straggler_detect_steps: int = _RUNTIME.steps + _RUNTIME.window // 2
    """Elastic, straggler policy rebalance or auto: steps at the current pace from a node's
    slowdown (or recovery) to its mark (or its mark's clearing). The runtime's StragglerConfig
    marks a node after `steps` = 10 consecutive steps whose median factor over a `window` = 5
    step window is >= the threshold; that median first reads slow at the 3rd slow step, so the
    mark comes at step 2 + 10 = 12. The re-split then waits for the next step boundary."""
    straggler_window_steps: int = _RUNTIME.window
    """Elastic: steps after a re-plan before a node still marked is re-split for again (the
    runtime's busy seconds restart with each generation and the leader waits for a full window)."""
    straggler_threshold: float = _RUNTIME.threshold
    """Elastic: a slowdown by a smaller factor is never marked (the runtime's StragglerConfig.threshold)."""
    straggler_min_gain: float = 0.1
    """Elastic: the leader re-splits for marked nodes only for an estimated step-time gain of at
    least this fraction (elastic/roles/leader_decisions.py REBALANCE_GAIN)."""
    spare_payback_s: float = 600.0
    """Elastic, straggler policy auto: a free spare replaces a marked node when, over this many
    seconds, it is estimated to train more steps than rebalancing, its shard fetch included (an
    assumption: the runtime cannot know how long a node stays slow)."""

    def __post_init__(self) -> None:
        for name in ("detect_s", "detect_process_s", "rebuild_s", "process_start_s"):
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
        if self.transfer_gbps is not None and not (math.isfinite(self.transfer_gbps) and self.transfer_gbps > 0):
            raise ValueError(f"--transfer-gbps must be a positive number, got {self.transfer_gbps}")
        if not 0.0 < self.finish_from <= 1.0:
            raise ValueError(f"finish_from must be in (0, 1], got {self.finish_from}")
        if not 0.0 <= self.recycle_hidden <= 1.0:
            raise ValueError(f"--recycle-hidden must be in [0, 1], got {self.recycle_hidden}")
        if not 0.0 <= self.redundant_forward <= 1.0:
            raise ValueError(f"--redundant-forward must be in [0, 1], got {self.redundant_forward}")
        self._check_stragglers()

    def _check_stragglers(self) -> None:
        for name in ("straggler_detect_steps", "straggler_window_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.straggler_threshold) and self.straggler_threshold > 1.0):
            raise ValueError(f"straggler_threshold must be a number > 1, got {self.straggler_threshold}")
        if not 0.0 <= self.straggler_min_gain < 1.0:
            raise ValueError(f"straggler_min_gain must be in [0, 1), got {self.straggler_min_gain}")
        if not (math.isfinite(self.spare_payback_s) and self.spare_payback_s > 0):
            raise ValueError(f"spare_payback_s must be a positive number, got {self.spare_payback_s}")

    @property
    def storage_bytes_per_s(self) -> float:
        return self.storage_gbps * GBIT

    def transfer_bytes_per_s(self, cluster: ClusterSpec) -> float:
        """Bytes a second one node fetches shards at: the transfer rate, capped by its NIC."""
        nic = cluster.network_bytes_per_s
        return nic if self.transfer_gbps is None else min(nic, self.transfer_gbps * GBIT)

    def transfer_text(self, cluster: ClusterSpec) -> str:
        """The transfer rate in words, for the policies' assumptions."""
        rate = self.transfer_bytes_per_s(cluster) / GBIT
        if self.transfer_gbps is None:
            return f"{rate:g} Gbit/s (the NIC)"
        return f"{rate:g} Gbit/s (measured, bench/README.md \"Recovery that loses less than a step\"; NIC {cluster.network_gbps:g})"

    def detection_s(self, cause: str | None) -> float:
        """Detection of a failure of `cause` (None: unknown, a lost host): `detect_process_s` when
        only the processes die, else `detect_s`."""
        return self.detect_process_s if cause is not None and effect_of(cause) == "process" else self.detect_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
