"""A node agent's preemption: SIGTERM (Kubernetes' and SLURM's notice, or torchrun passing its own
on) asks the leader for a drain of this node, as `elastic drain` does (a request under
`injections/`, by "sigterm"). When the leader meets it, the node leaves at the next step boundary
with nothing discarded: its workers hand their shards over and the agent exits 0. When the leader
refuses it (the other nodes could not form the job's f+1 pipelines) or it is not done within
$ELASTIC_PREEMPT_GRACE_S (default 20 s), the node leaves as a failure, exit 3 (`Agent.fail`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from elastic.coordinator.events import record_event
from elastic.coordinator.generations import Generations
from elastic.records.injection_requests import InjectionRequest, read_status, request_id, submit_request

if TYPE_CHECKING:
    from elastic.roles.agent import Agent

PREEMPT_GRACE_ENV = "ELASTIC_PREEMPT_GRACE_S"
PREEMPT_GRACE_S = 20.0
"""How long a SIGTERMed node may take to be drained before it leaves as a failure (module doc);
$ELASTIC_PREEMPT_GRACE_S overrides it. Below Kubernetes' default terminationGracePeriodSeconds
(30 s) and torchrun's shutdown timeout (30 s), which end the agent with SIGKILL after it."""
_PREEMPT_POLL_S = 0.1

log = logging.getLogger("elastic.agent")


class Preemption:
    """One agent's answer to a preemption notice (module doc)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._asked = False

    def preempt(self, grace_s: float) -> None:
        """SIGTERM: ask for a drain of this node from a thread of its own (module doc); a second
        SIGTERM changes nothing."""
        a = self.agent
        if self._asked or a.exit_code is not None:
            return
        self._asked = True
        threading.Thread(target=self._follow, args=(grace_s,), name="preempt", daemon=True).start()

    def _follow(self, grace_s: float) -> None:
        """Wait for the leader to meet the drain, and the workers to leave, until the grace ends."""
        a = self.agent
        deadline = time.monotonic() + grace_s
        try:
            req = self._request_drain()
        except Exception as exc:  # etcd away, no generation yet, ...: a failure, as before
            a.fail(f"preempted (SIGTERM) and no drain could be asked: {exc}")
            return
        log.warning("%s: preempted (SIGTERM): asked the leader for drain %s (grace %.0f s)", a.who, req.id, grace_s)
        drained = False
        while not a.done.wait(_PREEMPT_POLL_S):
            if time.monotonic() > deadline:
                what = "its workers did not hand over and leave" if drained else "the leader did not drain it"
                a.fail(f"preempted (SIGTERM): {what} within {grace_s:g} s (${PREEMPT_GRACE_ENV})")
                return
            if drained:
                continue  # the workers serve their shards, then exit 0 (`_on_death` finishes)
            try:
                status = read_status(a.client, a.keys.root, req.id)
            except Exception as exc:  # a transient etcd error: the deadline decides
                log.warning("%s: reading the drain's status: %s", a.who, exc)
                continue
            if status is not None and status.state == "refused":
                a.fail(f"preempted (SIGTERM) and the drain was refused: {status.detail}")
                return
            if status is not None and status.state == "done":
                drained = True
                log.warning("%s: drained by generation %s: leaving once the workers have handed over",
                            a.who, status.generation)

    def _request_drain(self) -> InjectionRequest:
        """Write the drain request of this node's incarnation; ValueError if it is in no generation."""
        a = self.agent
        from elastic.records.generation import GenerationRecord

        gen = Generations(a.client, a.keys).current()
        if gen is None or GenerationRecord.from_json(gen.plan).incarnations.get(a.node) != a.incarnation:
            raise ValueError(f"{a.who} (incarnation {a.incarnation}) is in no generation of the job yet")
        req = InjectionRequest(id=request_id("drain", a.node, None), kind="drain", node=a.node,
                               incarnation=a.incarnation, requested_at=time.time(), by="sigterm")
        submit_request(a.client, a.keys.root, req)
        record_event(a.client, a.keys, who=a.who, kind="preempted", node=a.node,
                     incarnation=a.incarnation, id=req.id)
        return req
