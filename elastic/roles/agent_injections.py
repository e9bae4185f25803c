"""A node agent's fault injections (elastic/records/injection_requests.py): the requests addressed to its
node and incarnation, carried out once each, on a thread of their own.

Watching `injections/`, the agent (elastic/roles/agent.py) hands each request here: kill (SIGKILL
the workers), hang (SIGSTOP workers and agent: the lease expires), slow (a SIGSTOP/SIGCONT duty
cycle on the workers, which the agent's hang detector knows is not a hang: `throttled`) and
partition (emulated: keepalives stop, the leader steps down and the workers are SIGSTOPped for
the given seconds; after the heal the node finds itself fenced, kills its workers before they
run again and exits 5, EXIT_FENCED). Each waits for its step (`InjectionTrigger`) and writes its status.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING

from elastic.coordinator.events import record_event
from elastic.coordinator.generations import Generations
from elastic.coordinator.membership import NodeIdentity
from elastic.coordinator.watch import WatchEvent
from elastic.records.injection_requests import (
    AGENT_KINDS,
    InjectionRequest,
    InjectionStatus,
    State,
    read_statuses,
    write_status,
)
from elastic.records.throttle import Throttle
from elastic.roles.exit_codes import EXIT_FAILED, EXIT_FENCED
from elastic.roles.injection_trigger import InjectionTrigger

if TYPE_CHECKING:
    from elastic.roles.agent import Agent

log = logging.getLogger("elastic.agent")


class NodeInjections:
    """The injections of one agent's node incarnation (module doc)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.hanging = False
        """A hang was injected: the lease must expire, not be revoked."""
        self.partitioned = False
        """A partition was injected: the lease must expire, not be revoked."""
        self.signal_lock = threading.Lock()
        """Held while workers are signalled by a Throttle."""
        self.throttles: list[Throttle] = []
        """The slow-downs running now."""
        self.threads: list[threading.Thread] = []
        """One a request carried out (a partition cut short writes its status on the way out)."""
        self.trigger: InjectionTrigger | None = None
        self._seen: set[str] = set()

    def open(self) -> InjectionTrigger:
        """Start following the job's steps, which the requests wait for; the trigger."""
        self.trigger = InjectionTrigger(self.agent.client, self.agent.keys, lease=self.agent.membership.lease_id)
        return self.trigger

    def throttled(self) -> bool:
        """Whether a slow-down has stopped the workers on purpose (call under `signal_lock`)."""
        return any(t.active for t in self.throttles)

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for each request's thread."""
        for thread in self.threads:
            thread.join(timeout=timeout)

    # ---- injections ----------------------------------------------------------------------

    def on_requests(self, events: list[WatchEvent]) -> None:
        a = self.agent
        for ev in events:
            if ev.kind != "put":
                continue
            try:
                req = InjectionRequest.from_json(ev.value)
            except (ValueError, TypeError, KeyError) as exc:
                log.warning("%s: ignoring malformed injection request %s: %s", a.who, ev.key, exc)
                continue
            if (req.node, req.incarnation) != (a.node, a.incarnation) or req.kind not in AGENT_KINDS:
                continue
            if req.id in self._seen:
                continue
            self._seen.add(req.id)
            thread = threading.Thread(target=self._inject, args=(req,), name=f"inject-{req.id}", daemon=True)
            self.threads.append(thread)
            thread.start()

    def _status(self, req: InjectionRequest, state: State, step: int | None, *, detail: str = "",
                generation: int | None = None) -> None:
        a = self.agent
        status = InjectionStatus(state=state, at=time.time(), step=step, generation=generation, detail=detail)
        write_status(a.client, a.keys.root, req.id, status)

    def _inject(self, req: InjectionRequest) -> None:
        a = self.agent
        trigger = self.trigger
        assert trigger is not None
        if req.id in read_statuses(a.client, a.keys.root):
            return  # carried out before
        if not trigger.wait(req, a.done):
            return
        step = trigger.in_flight()
        a.client.put(a.rk.injected(req.id), repr(time.time()))
        record_event(a.client, a.keys, who=a.who, kind="injection", id=req.id, injection=req.kind,
                     node=a.node, incarnation=a.incarnation, step=step)
        log.warning("%s: injecting %s (step %d in flight)", a.who, req.id, step)
        if req.kind == "kill":
            self._status(req, "done", step, detail="workers SIGKILLed")
            for proc in a.procs.values():
                proc.send_signal(signal.SIGKILL)
        elif req.kind == "hang":
            self._status(req, "done", step, detail="workers and agent SIGSTOPped")
            self.hanging = True
            if a.monitor is not None:
                a.monitor.stop()
            for proc in a.procs.values():
                proc.send_signal(signal.SIGSTOP)
            os.kill(os.getpid(), signal.SIGSTOP)
        elif req.kind == "slow":
            self._slow(req, step)
        elif req.kind == "partition":
            self._partition(req, step)

    def _slow(self, req: InjectionRequest, step: int) -> None:
        a = self.agent
        assert req.factor is not None and (req.seconds is not None or req.steps is not None)
        trigger = self.trigger
        assert trigger is not None
        seconds = req.seconds if req.seconds is not None else float("inf")
        throttle = Throttle(list(a.procs), factor=req.factor, seconds=seconds, lock=self.signal_lock,
                            hold_cpu=req.hold_cpu, cgroup=a.cpu_group)
        self.throttles.append(throttle)
        how_long = f"{req.seconds:g} s" if req.steps is None else f"steps {step}-{step + req.steps - 1}"
        self._status(req, "running", step, detail=f"workers run 1/{req.factor:g} of the time for {how_long}"
                     + (" (a burner spins in each one's place while it is stopped)" if req.hold_cpu else ""))
        t0 = time.monotonic()
        if req.steps is None:
            throttle.run(a.done)
        else:
            last = step + req.steps - 1
            with trigger.watching():
                throttle.run(a.done, until=lambda: trigger.in_flight() > last)
        self.throttles.remove(throttle)
        self._status(req, "done", trigger.in_flight(),
                     detail=f"slowed from step {step}: workers stopped {throttle.stopped_s:.1f} s of "
                     f"{time.monotonic() - t0:.1f} s")

    def _partition(self, req: InjectionRequest, step: int) -> None:
        """Emulated partition (module doc); with a network-namespace launch the link is cut for real."""
        a = self.agent
        assert req.seconds is not None and a.membership.lease is not None
        self.partitioned = True
        self._status(req, "running", step, detail=f"keepalives and workers stopped for {req.seconds:g} s")
        if a.monitor is not None:
            a.monitor.stop()
        if a.leader is not None:
            a.leader.stop()
        # A partitioned leader reaches no one: its rounds stop here and it steps down (in a real
        # partition its leader key would expire instead, a TTL later).
        a.election.resign()
        a.membership.lease.stop_refreshing()
        for proc in a.procs.values():
            proc.send_signal(signal.SIGSTOP)
        cut_short = a.done.wait(req.seconds)
        value, _ = a.client.get(a.keys.member(a.who))
        fenced = value is None or NodeIdentity.from_json(value).incarnation != a.incarnation
        generation = Generations(a.client, a.keys).current_number()
        if cut_short:  # stopped while partitioned (e.g. the launcher replaced the node by a rejoin)
            self._status(req, "fenced" if fenced else "done", step, generation=generation,
                         detail=f"the agent was stopped while partitioned ({'lease gone, ' if fenced else ''}"
                         f"job at generation {generation})")
            if fenced:
                record_event(a.client, a.keys, who=a.who, kind="fenced", incarnation=a.incarnation,
                             generation=generation, reason=f"partition of {req.seconds:g} s (agent stopped)")
            return
        # The workers still hold generation-old state and are stopped mid-step: they are killed
        # before they run again, so nothing of theirs can reach the job after the fencing.
        with a.lock:
            a.kill_workers()
            if fenced:
                self._status(req, "fenced", step, generation=generation,
                             detail=f"healed after {req.seconds:g} s: lease gone, job at generation {generation}; "
                             "workers killed before they ran again")
                record_event(a.client, a.keys, who=a.who, kind="fenced", incarnation=a.incarnation,
                             generation=generation, reason=f"partition of {req.seconds:g} s")
            else:  # healed within the TTL, but keepalives stopped: leave cleanly rather than linger
                a.membership.report_failure(reason=f"partition of {req.seconds:g} s healed; leaving")
                self._status(req, "done", step, detail="healed before the lease expired; the node left")
            a.finish(EXIT_FENCED if fenced else EXIT_FAILED)
