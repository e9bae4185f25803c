"""`ElasticConfig`: the job spec and the run's settings, at the job's `config` key.

The launcher writes it once before anything starts; every worker, agent, the leader and the
operator CLI read it (elastic/coordinator/schema.py lists every key of a job).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic.coordinator.jsonrecord import JsonRecord
from elastic.planning.cluster import ClusterSpec
from elastic.planning.stragglers import StragglerConfig
from elastic.records.injection import Injection
from elastic.records.job import JobSpec
from elastic.records.resume import ResumeSource


@dataclass(frozen=True, kw_only=True)
class ElasticConfig(JsonRecord):
    """What every process of an elastic run reads from etcd's `config` key."""

    spec: JobSpec
    """The training job; `spec.plan` is the plan of the first generation."""
    cluster: ClusterSpec
    """Planner inputs for the leader's re-planning (its `nodes` is the largest node count)."""
    injections: tuple[Injection, ...] = ()
    """Faults to inject, each carried out by the agent of its node (or the launcher for rejoin)."""
    checkpoint_every: int = 5
    """Committed steps between checkpoints (0: never)."""
    checkpoint_dir: str = ""
    """Directory of the checkpoints; empty means `<run_dir>/checkpoints`."""
    lease_ttl: int = 3
    """Seconds of silence after which etcd declares a node lost."""
    resume: ResumeSource | None = None
    """`elastic run --resume`: the earlier run's checkpoint that generation 1 restores (None: a
    fresh run, initialised from the seed)."""
    spares: int = 0
    """`elastic run --spares K`: hot spare nodes started beside the plan's nodes (node ids after
    the plan's); the leader keeps `cluster.nodes` nodes training and takes a spare in, in the
    same re-plan, for each node lost (elastic/planning/spares.py)."""
    stragglers: StragglerConfig = StragglerConfig()
    """`elastic run --straggler-policy/--straggler-threshold/--straggler-steps`: when a node counts
    as a straggler, and what is done about it (elastic/planning/stragglers.py)."""

    @property
    def checkpoint_path(self) -> str:
        return self.checkpoint_dir or f"{self.spec.run_dir}/checkpoints"
