"""Where an elastic worker's committed steps go: world rank 0 hands each to the progress writer
(the `progress` key the launcher follows) and to the straggler reporter (each node's phases of
the step); each pipeline's first worker appends it to its local step log (the run summary's
source for local agents)."""

from __future__ import annotations

from typing import TextIO

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.parallel.layout import ParallelLayout
from elastic.parallel.phase_clock import StepPhases
from elastic.records.config import ElasticConfig
from elastic.records.progress import StepResult, step_log_path
from elastic.roles.straggler_reporter import StragglerReporter
from elastic.roles.worker_feeds import ProgressWriter


class StepRecorder:
    """One worker's records of its committed steps (module doc)."""

    def __init__(self, client: EtcdClient, keys: JobKeys, config: ElasticConfig, *, node: int,
                 local_rank: int) -> None:
        self.client, self.keys, self.config = client, keys, config
        self.node, self.local_rank = node, local_rank
        self.progress = ProgressWriter(client, RunKeys(keys))
        self.stragglers: StragglerReporter | None = None
        """Speed factors and straggler marks, while this worker is world rank 0."""
        self._step_log: TextIO | None = None

    def record(self, layout: ParallelLayout, result: StepResult, *,
               phases: dict[int, StepPhases] | None = None) -> float:
        """Hand a committed step to the progress writer and the straggler reporter (world rank
        0) and the local step log (each pipeline's first worker); the commit's wall time. `phases`:
        each node's forward, backward and wait seconds of the step (the vote's), None for a step
        with no measure."""
        now = result.committed_at
        if layout.rank != 0 and self.stragglers is not None:  # another worker is rank 0 now: it reports
            self.stragglers.close()
            self.stragglers = None
        if layout.rank == 0:
            self.progress.publish(result)
            if phases:  # also under `off`: the reporter reads the operator's changes of policy
                if self.stragglers is None:
                    self.stragglers = StragglerReporter(self.client, self.keys, self.config.stragglers,
                                                        who=f"node{self.node}/{self.local_rank}")
                self.stragglers.observe(step=result.step, generation=result.generation, phases=phases,
                                        plan=layout.plan)
        if layout.stage == 0 and layout.tp_rank == 0:
            if self._step_log is None:
                path = step_log_path(self.config.spec.run_dir, self.node, self.local_rank)
                path.parent.mkdir(parents=True, exist_ok=True)
                torn = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
                self._step_log = path.open("a", buffering=1)
                if torn:  # a killed predecessor's half line: end it, so this line parses
                    self._step_log.write("\n")
            self._step_log.write(result.to_json() + "\n")
        return now

    def close_reports(self) -> None:
        """Stop the progress writer (its last step written) and the straggler reporter."""
        self.progress.close()
        if self.stragglers is not None:
            self.stragglers.close()

    def close(self) -> None:
        """`close_reports`, and close the step log."""
        self.close_reports()
        if self._step_log is not None:
            self._step_log.close()
