"""What a policy's simulation returns, and the step arithmetic the policies share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from elastic.sim.copies import CopyLosses
from templates.plan import Plan

_EPS = 1e-9


def whole_steps(duration_s: float, iteration_s: float) -> int:
    """Steps that complete in `duration_s` at `iteration_s` each (0 for a non-positive duration)."""
    if duration_s <= 0:
        return 0
    return int(math.floor(duration_s / iteration_s + _EPS))


@dataclass(frozen=True, kw_only=True)
class Segment:
    """A stretch of the run with one configuration."""

    start_s: float
    """When training resumes with this configuration."""
    live: int
    """Live nodes."""
    used: int
    """Nodes the plan uses (the rest are spares)."""
    pipelines: int
    """Pipelines of the plan."""
    iteration_s: float
    """Seconds per step of the plan (the planner's cost model)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "start_s": self.start_s,
            "live": self.live,
            "used": self.used,
            "pipelines": self.pipelines,
            "iteration_s": self.iteration_s,
        }


@dataclass(kw_only=True)
class PolicyResult:
    """Totals of one policy over one trace; the time fields add up to the horizon."""

    policy: str
    """Policy name."""
    assumptions: list[str]
    """Every assumption the policy's model makes, in words."""
    steps: int = 0
    """Optimizer steps that count: committed and never rolled back."""
    samples: int = 0
    """steps x global batch."""
    training_s: float = 0.0
    """Seconds spent computing steps, including steps later discarded."""
    recovery_s: float = 0.0
    """Seconds not training because of a membership change: detection, planning, transfers,
    rebuilds, restarts, and time stalled without a plan."""
    checkpoint_s: float = 0.0
    """Seconds spent writing checkpoints (training paused)."""
    lost_s: float = 0.0
    """Training seconds whose work was discarded (in-flight steps, work since the last checkpoint),
    or, for the elastic policy's partial replay, spent recomputing the lost pipelines' microbatches."""
    failures: int = 0
    """Node failures in the trace."""
    joins: int = 0
    """Node joins in the trace."""
    reconfigurations: int = 0
    """Changes of plan made without restarting the job."""
    restarts: int = 0
    """Job restarts from a checkpoint."""
    spares_taken: int = 0
    """Failures whose re-plan took a hot spare in (the elastic policy with `--spares`)."""
    resplits: int = 0
    """Re-splits of the global batch's microbatches for slow nodes, and back (elastic policy,
    straggler policy rebalance or auto); they are not counted in `reconfigurations`."""
    slow_swaps: int = 0
    """Slow nodes replaced by a hot spare (elastic policy, straggler policy auto); they are
    counted in `reconfigurations` too."""
    stalled_at: float | None = None
    """When the policy could no longer form any plan (it trains nothing after that)."""
    segments: list[Segment] = field(default_factory=list)
    """Each configuration the policy ran, in order."""
    infeasible: str = ""
    """Why the policy cannot run this job at all ('' if it can)."""
    copies: CopyLosses | None = None
    """The elastic policy's last-copy losses and exposure, full replicas beside sharded
    optimizer slices (elastic/sim/copies.py); None for the other policies."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "assumptions": self.assumptions,
            "steps": self.steps,
            "samples": self.samples,
            "training_s": self.training_s,
            "recovery_s": self.recovery_s,
            "checkpoint_s": self.checkpoint_s,
            "lost_s": self.lost_s,
            "failures": self.failures,
            "joins": self.joins,
            "reconfigurations": self.reconfigurations,
            "restarts": self.restarts,
            "spares_taken": self.spares_taken,
            "resplits": self.resplits,
            "slow_swaps": self.slow_swaps,
            "stalled_at": self.stalled_at,
            "infeasible": self.infeasible,
            "segments": [s.to_dict() for s in self.segments],
            **({"copies": self.copies.to_dict()} if self.copies is not None else {}),
        }


def train_interrupted(res: PolicyResult, ran_s: float, iteration_s: float) -> None:
    """Add `ran_s` of training cut by a change: whole steps count, the in-flight one is lost."""
    done = whole_steps(ran_s, iteration_s)
    res.steps += done
    res.training_s += ran_s
    res.lost_s += ran_s - done * iteration_s


def segment_of(start_s: float, live: int, plan: Plan, iteration_s: float | None = None) -> Segment:
    """The segment that runs `plan` from `start_s` with `live` nodes (at `iteration_s` a step,
    default the plan's own estimate)."""
    it = plan.iteration_time if iteration_s is None else iteration_s
    return Segment(start_s=start_s, live=live, used=len(plan.nodes), pipelines=len(plan.pipelines), iteration_s=it)


def add_segment(res: PolicyResult, segment: Segment) -> None:
    """Append `segment`, replacing the last one if it starts at the same time (a change of pace
    during a recovery: the configuration resumes at the new pace)."""
    if res.segments and res.segments[-1].start_s == segment.start_s:
        res.segments.pop()
    res.segments.append(segment)
