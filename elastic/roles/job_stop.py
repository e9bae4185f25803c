"""The launcher's side of a whole-job stop that saves (elastic/records/stop.py).

`JobStop` is what `elastic run`'s signal handlers set on the first Ctrl-C or SIGTERM: plain
attributes, no lock and no I/O, so a handler may set it whatever the main thread is doing.
`StopTracker`, called from the launcher's loop, writes the stop request once it is asked,
notices one that `elastic drain --all` wrote (the launcher reads the `stop` key once a second),
and says when the job has stopped: the leader wrote the stop step S into the current
generation's halt, every worker of that generation reported done (its checkpoint shards of
step S are on disk), and the checkpoint of step S is complete in the job's checkpoint
directory. `launch_elastic` then ends with `JobStopped` (the outcome and the summary of the
steps committed). A stop not done within `JobStop.grace_s` ends it with `StopTimedOut`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.keys import JobKeys
from elastic.engine.checkpoint.files import complete_steps
from elastic.records.config import ElasticConfig
from elastic.records.stop import (
    By,
    StopPoint,
    StopRequest,
    read_stop,
    read_stop_point,
    submit_stop,
    workers_not_done,
)
from elastic.records.summary import RunSummary

STOP_GRACE_ENV = "ELASTIC_STOP_GRACE_S"
STOP_GRACE_S = 60.0
"""How long a stop that saves may take, from its request to the last worker's checkpoint on disk,
before the launcher stops every process at once; $ELASTIC_STOP_GRACE_S overrides it."""
_LOOK_S = 0.1
"""How often the launcher looks at a stopping job (etcd reads: only while it stops)."""


@dataclass(kw_only=True)
class JobStop:
    """A stop that saves, asked of a running `launch_elastic` from a signal handler."""

    grace_s: float = STOP_GRACE_S
    """Seconds the stop may take before everything is stopped at once (StopTimedOut)."""
    by: By | None = None
    """Who asked (None: not asked)."""
    armed: bool = False
    """Set by the launcher while the job runs (generation 1 published, not yet ended): before and
    after, there is nothing to save and a signal stops at once."""

    def ask(self, by: By) -> bool:
        """Ask for the stop; False when it was asked before (the first asker stands)."""
        if self.by is not None:
            return False
        self.by = by
        return True


@dataclass(frozen=True, kw_only=True)
class StopOutcome:
    """How a stopped job stands."""

    step: int
    """Committed steps: the step of the stop's checkpoint."""
    generation: int
    """The job's last generation."""
    by: By
    """Who asked for the stop."""
    checkpoint_dir: str
    """The job's checkpoint directory."""
    complete: bool
    """Whether the checkpoint of `step` is complete there (False: a worker failed to write it;
    a resume takes the newest complete one)."""


class JobStopped(Exception):
    """The job stopped on request at a step boundary (`outcome`), `summary` its committed steps."""

    def __init__(self, outcome: StopOutcome, summary: RunSummary) -> None:
        super().__init__(f"stopped at step {outcome.step}")
        self.outcome, self.summary = outcome, summary


class StopTimedOut(RuntimeError):
    """A stop that saves was not done within its grace period; every process was stopped at once."""


class StopTracker:
    """The launcher's loop's view of a stop (module doc)."""

    def __init__(self, *, client: EtcdClient, keys: JobKeys, config: ElasticConfig, say: Callable[[str], None],
                 job_stop: JobStop | None) -> None:
        self.client, self.keys, self.config, self.say, self.job_stop = client, keys, config, say, job_stop
        self.request: StopRequest | None = None
        """The job's stop request, once written or found."""
        self.point: StopPoint | None = None
        """Where the job stops, once the leader decided."""
        self._since = 0.0
        self._next_look = 0.0

    def poll(self, *, read_now: bool, final: bool = False) -> StopOutcome | None:
        """The outcome once the job has stopped (with `final`, every agent has exited: the outcome
        even if some worker did not report done), else None; StopTimedOut past the grace."""
        if self.request is None and not self._take_request(read_now):
            return None
        now = time.monotonic()
        if now < self._next_look and not final:
            return None
        self._next_look = now + _LOOK_S
        grace = self.job_stop.grace_s if self.job_stop is not None else STOP_GRACE_S
        if now - self._since > grace and not final:
            raise StopTimedOut(f"the stop was not done within {grace:g} s (${STOP_GRACE_ENV}); stopped every "
                               "process at once: a resume starts from the newest complete checkpoint")
        if self.point is None:
            self.point = read_stop_point(self.client, self.keys)
            if self.point is None:
                return None
            self.say(f"elastic run: the job stops after step {self.point.step} (generation {self.point.generation}): "
                     f"every worker writes its checkpoint of step {self.point.step}")
        if not final and workers_not_done(self.client, self.keys, self.point.plan):
            return None
        assert self.request is not None
        directory = self.config.checkpoint_path
        steps = complete_steps(Path(directory), num_layers=self.config.spec.model_config.num_layers,
                               tp_degree=self.config.spec.plan.gpus_per_node)
        return StopOutcome(step=self.point.step, generation=self.point.generation, by=self.request.by,
                           checkpoint_dir=directory, complete=self.point.step in steps)

    def _take_request(self, read_now: bool) -> bool:
        """Write the request once asked here, or take one found in etcd (read once a second)."""
        if self.job_stop is not None and self.job_stop.by is not None:
            self.request, ours = submit_stop(self.client, self.keys, self.job_stop.by)
            if not ours:
                self.say(f"elastic run: a stop was already asked ({self.request.words()})")
        elif read_now:
            self.request = read_stop(self.client, self.keys)
            if self.request is None:
                return False
            self.say(f"elastic run: stop asked by {self.request.words()}: finishing the step in flight, then every "
                     "worker writes a checkpoint at that step boundary")
        else:
            return False
        self._since = time.monotonic()
        return True
