"""Which generation an elastic worker enters next, and how it leaves the job's generations.

A worker enters the newest generation that includes its node's incarnation. Until one does, its
node is a hot spare (elastic/planning/spares.py): it waits outside every generation with its model
skeleton built, for as long as the job runs (`SpareDone` once the job finished or stops). A
generation without its node that names it in `drained` ends its part (`Drained`); after a
boundary halt, the leader may mark the halt as the whole job's stop (`Stopped`,
elastic/records/stop.py).
"""

from __future__ import annotations

import time

import torch

from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.keys import RunKeys
from elastic.parallel.layout import ParallelLayout
from elastic.records.job import JobSpec
from elastic.records.progress import read_progress
from elastic.roles.worker_feeds import GenerationFeed, HaltFeed
from elastic.roles.worker_log import worker_log
from elastic.transfer.server import ShardServer

_SPARE_POLL_S = 1.0
"""How often a hot spare that no generation includes looks whether the job has finished."""
_STOP_LOOK_S = 0.05
"""How often a worker halted at a step boundary looks whether the leader stopped the job there
(a newer generation ends the wait at once)."""


class Drained(Exception):
    """This worker's node was drained out of the job by generation `generation`."""

    def __init__(self, generation: int) -> None:
        super().__init__(f"drained by generation {generation}")
        self.generation = generation


class SpareDone(Exception):
    """This worker's node was a hot spare to the end: the job finished without needing it."""


class Stopped(Exception):
    """The whole job stops after `step` committed steps (elastic/records/stop.py)."""

    def __init__(self, step: int, layout: ParallelLayout) -> None:
        super().__init__(f"the job stops after step {step}")
        self.step, self.layout = step, layout


class GenerationWaiter:
    """One worker's way through the job's generations (module doc)."""

    def __init__(self, *, client: EtcdClient, rk: RunKeys, spec: JobSpec, node: int, incarnation: int,
                 generations: GenerationFeed, halts: HaltFeed, server: ShardServer, timeout: float) -> None:
        self.client, self.rk, self.spec = client, rk, spec
        self.node, self.incarnation = node, incarnation
        self.generations, self.halts, self.server, self.timeout = generations, halts, server, timeout
        self._joined = False
        """Whether this worker has entered a generation (until then its node is a hot spare)."""
        self._spare_skeleton: torch.nn.Module | None = None
        """A hot spare's model skeleton (meta device: shapes, no memory), built while it waits."""

    def next(self, after: int) -> int:
        """The newest generation after `after` that includes this node's incarnation."""
        while True:
            try:
                number = self.generations.wait_newer(after, _SPARE_POLL_S if after > 0 and not self._joined
                                                     else self.timeout * 4)
            except TimeoutError:
                if self._joined or after == 0:
                    raise
                self._wait_as_spare()  # a hot spare waits for as long as the job runs
                continue
            record, _ = self.generations.get(number)
            if record.incarnations.get(self.node) == self.incarnation:
                self._joined = True
                return number
            if self.node in record.drained and self.node not in record.incarnations:
                self.server.set_generation(number)  # survivors fetch from us under this generation
                raise Drained(number)
            if self._joined and self.node not in record.incarnations:
                raise RuntimeError(f"node {self.node} is not part of generation {number}: leaving the job")
            after = number
            if not self._joined:
                self._wait_as_spare()

    def await_stop(self, generation: int, layout: ParallelLayout) -> None:
        """After a boundary halt of `generation`: wait for the next generation, or for the leader
        to mark the halt as the job's stop (Stopped)."""
        deadline = time.monotonic() + self.timeout * 4
        while True:
            halt = self.halts.requested(generation)
            if halt is not None and halt.stop_step is not None:
                raise Stopped(halt.stop_step, layout)
            if halt is None or halt.abort or time.monotonic() > deadline:
                return
            try:
                self.generations.wait_newer(generation, _STOP_LOOK_S)
                return
            except TimeoutError:
                continue

    def _wait_as_spare(self) -> None:
        """Between two looks at the generations, as a hot spare (elastic/planning/spares.py):
        build the model skeleton once (torch and the model code are warm when a re-plan takes
        this node in), and leave (SpareDone) once every step of the job is committed."""
        if self._spare_skeleton is None:
            from elastic.model.gpt import GPTStage

            with torch.device("meta"):
                self._spare_skeleton = GPTStage(self.spec.model_config, initialise=False)
            worker_log("hot spare: agent and workers up, model skeleton built, no layers held")
        record = read_progress(self.client, self.rk)
        if record is not None and record.step + 1 >= self.spec.steps:
            raise SpareDone()
        halt = self.halts.requested(self.generations.latest())
        if halt is not None and halt.stop_step is not None:  # the whole job stops: nothing to wait for
            raise SpareDone()
