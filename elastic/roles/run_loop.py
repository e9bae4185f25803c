"""The elastic launcher's loop while its job runs: it relays what the job's feed delivers (one
line a committed step, failure and recovery), carries out rejoin requests (once the node's
member is gone and the request's step is in flight, any process left of the node's older
incarnations is killed and an agent for its next incarnation started), and decides when the
run is over: finished, failed (the leader gave up, every agent exited), timed out, or stopped
on request with a checkpoint (elastic/roles/job_stop.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from elastic.coordinator.client import etcd_unreachable
from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.events import record_event
from elastic.coordinator.keys import JobKeys, RunKeys, why_failed
from elastic.records.config import ElasticConfig
from elastic.records.injection_requests import (
    InjectionRequest,
    InjectionStatus,
    read_requests,
    read_statuses,
    write_status,
)
from elastic.records.progress import add_step_waiter, committed_steps, drop_step_waiter
from elastic.roles.agent_pool import AgentPool, kill_workers
from elastic.roles.interrupt import Interrupt
from elastic.roles.job_stop import JobStop, JobStopped, StopOutcome, StopTracker
from elastic.roles.launch_errors import JobFailed
from elastic.roles.launcher_feed import (
    JobFeed,
    Progress,
    elastic_summary,
    final_poll,
    poll_progress,
    run_finished,
)

_READ_EVERY_S = 1.0
"""How often the elastic launcher's loop reads etcd itself (fatal key, rejoin requests, the end)."""
_WAIT_S = 0.25
"""Longest sleep of the loop between feed deliveries: how late it notices an agent's exit, a stop
asked from another thread, its time limit. Each delivery wakes it at once."""


@dataclass(kw_only=True)
class RunLoop:
    """The launcher's side of a running elastic job: relays what the feed delivers, carries out
    rejoin requests, and decides when the run is over (finished, failed, timed out, stopped)."""

    config: ElasticConfig
    """The job's configuration."""
    client: EtcdClient
    """The launcher's etcd client."""
    keys: JobKeys
    """The job's keys."""
    feed: JobFeed
    """Every step, plan and worker of the job, as its watches deliver them."""
    progress: Progress
    """What has been seen of the run so far."""
    pool: AgentPool
    """The agents started here."""
    say: Callable[[str], None]
    """Prints one line for people (or nothing, when quiet)."""
    start: float
    """monotonic() at the launch, the origin of `timeout_s`."""
    timeout_s: float | None
    """Run time after which the run ends with TimeoutError (None: no limit)."""
    stop: threading.Event | None
    """Set from another thread to end the run with JobFailed."""
    job_stop: JobStop | None = None
    """Set by `elastic run`'s signal handlers: stop the job at a step boundary with a checkpoint
    (elastic/roles/job_stop.py); armed here while the job runs."""
    interrupt: Interrupt | None = None
    """Asked by a signal handler: the loop raises Interrupted at its next turn (interrupt.py)."""
    started_at: float = 0.0
    """Wall time of the launch (the origin of a stopped run's summary)."""
    rejoin_fenced: int = 0
    """How many times a node that left fenced while it lived (EXIT_FENCED) is started again, as its
    next incarnation (`elastic run --rejoin-fenced N`; 0: it stays out)."""
    _fenced_rejoins: dict[int, int] = field(init=False, default_factory=dict)
    """node -> the fenced rejoins started for it so far."""
    _stopping: StopTracker = field(init=False)
    _stopped: StopOutcome | None = field(init=False, default=None)
    _step_waiter: str | None = field(init=False, default=None)
    """The step-waiters key held while a rejoin waits for its step."""

    def __post_init__(self) -> None:
        self._stopping = StopTracker(client=self.client, keys=self.keys, config=self.config, say=self.say,
                                     job_stop=self.job_stop)

    def follow(self) -> None:
        """Poll until every step is committed and every worker is done; raises JobFailed or
        TimeoutError when the run cannot finish, JobStopped once it stopped on request with a
        checkpoint (elastic/records/stop.py), StopTimedOut if that stop took too long. `job_stop`
        is armed meanwhile."""
        if self.job_stop is not None:
            self.job_stop.armed = True
        try:
            self._follow()
        finally:
            if self.job_stop is not None:
                self.job_stop.armed = False
            self._wait_for_steps(False)
        if self._stopping.request is not None:
            self.say(f"elastic run: the job finished its last step before the stop ({self._stopping.request.words()}) "
                     "took effect")

    def _follow(self) -> None:
        requests: list[InjectionRequest] = []
        next_read = 0.0
        etcd_out = False
        while True:
            try:
                self.poll()
                # etcd is read here only once a second (the feed's watches deliver the rest), so a
                # fast step loop does not pay for the launcher's polling.
                read_now = time.monotonic() >= next_read
                if read_now:
                    next_read = time.monotonic() + _READ_EVERY_S
                    requests = self._read_requests()
                    self._wait_for_steps(any(r.kind == "rejoin" and r.when == "step" and r.id not in self.progress.rejoined
                                             for r in requests))
                for req in _due_rejoins(self.client, self.keys, self.progress, requests):
                    self._rejoin(req)
                self._rejoin_fenced()
                if self._finished(read_now):
                    break
                etcd_out = False
            except Exception as exc:
                if not etcd_unreachable(exc):
                    raise
                # etcd out of reach past the client's retries (a lost quorum, a restart): the
                # job's own processes ride it out, and so does the launcher (its time limit holds)
                if not etcd_out:
                    self.say(f"elastic run: etcd did not answer ({type(exc).__name__}); waiting for it")
                etcd_out = True
                self._check_limits()
            self.feed.wait(_WAIT_S)  # woken by what the watches deliver (a progress put, a plan)
        if self._stopped is not None:
            final_poll(self.client, self.keys, self.config, self.progress, self.say, self.feed)
            raise JobStopped(self._stopped, elastic_summary(self.config, self.progress, started_at=self.started_at))

    def _wait_for_steps(self, waiting: bool) -> None:
        """Hold a step waiter while a rejoin waits for its step (elastic/records/progress.py:
        the progress key then comes at its short interval), and drop it once none does."""
        if waiting and self._step_waiter is None:
            self._step_waiter = add_step_waiter(self.client, RunKeys(self.keys))
        elif not waiting and self._step_waiter is not None:
            drop_step_waiter(self.client, self._step_waiter)
            self._step_waiter = None

    def poll(self) -> None:
        """Take in what the feed delivered (prints step, failure and recovery lines)."""
        poll_progress(self.client, self.keys, self.config, self.progress, self.say, self.feed)

    def _read_requests(self) -> list[InjectionRequest]:
        """The job's injection requests; JobFailed if the leader or a worker gave up (the `fatal` key)."""
        fatal, _ = self.client.get(self.keys.fatal)
        if fatal is not None:
            raise JobFailed(why_failed(fatal.decode()))
        return read_requests(self.client, self.keys.root)

    def _rejoin(self, req: InjectionRequest) -> None:
        """Carry out one due rejoin: end what is left of the node, start its next incarnation."""
        self.progress.rejoined.add(req.id)
        self.client.put(RunKeys(self.keys).injected(req.id), repr(time.time()))
        incarnation = self._restart(req.node)
        self.say(f"elastic run: node {req.node} rejoins (incarnation {incarnation})")
        status = InjectionStatus(state="done", at=time.time(), detail=f"incarnation {incarnation} started")
        write_status(self.client, self.keys.root, req.id, status)

    def _rejoin_fenced(self) -> None:
        """Start the next incarnation of each node whose agent left fenced while the node lived, up
        to `rejoin_fenced` times a node: it registers anew and joins at a step boundary like any new
        node, fetching its shards (the fenced workers' are steps behind the survivors' by then)."""
        if not self.rejoin_fenced or self.progress.committed >= self.config.spec.steps:
            return
        for agent in self.pool.fenced():
            done = self._fenced_rejoins.get(agent.node, 0)
            if done >= self.rejoin_fenced:
                continue
            self._fenced_rejoins[agent.node] = done + 1
            incarnation = self._restart(agent.node)
            self.say(f"elastic run: node {agent.node} was fenced while it lived (incarnation {agent.incarnation}); "
                     f"it rejoins as incarnation {incarnation} ({done + 1} of {self.rejoin_fenced})")
            record_event(self.client, self.keys, who="launcher", kind="fenced-rejoin", node=agent.node,
                         incarnation=incarnation, fenced=agent.incarnation)

    def _restart(self, node: int) -> int:
        """End what is left of `node` (its agent, its workers) and start its next incarnation; its number."""
        incarnation = self.pool.next_incarnation(node)
        self.pool.stop_node(node)
        kill_workers(self.progress, node=node)
        self.pool.spawn(node, incarnation)
        return incarnation

    def _finished(self, read_now: bool) -> bool:
        """Whether the run finished (True) or goes on (False); raises why it must stop otherwise."""
        steps = self.config.spec.steps
        rk = RunKeys(self.keys)
        if (read_now or self.progress.committed >= steps) and run_finished(self.client, rk, self.progress, steps):
            return True
        self._stopped = self._stopping.poll(read_now=read_now)
        if self._stopped is not None:
            return True
        if self.pool.all_exited():
            self.poll()
            if run_finished(self.client, rk, self.progress, steps):
                return True
            self._stopped = self._stopping.poll(read_now=True, final=True)
            if self._stopped is not None:
                return True
            raise JobFailed(self.pool.exit_report(steps))
        self._check_limits()
        return False

    def _check_limits(self) -> None:
        """TimeoutError past the run's time limit, JobFailed once stopped on request, Interrupted once
        a signal asked to stop at once."""
        if self.interrupt is not None:
            self.interrupt.check()
        if self.timeout_s is not None and time.monotonic() - self.start > self.timeout_s:
            raise TimeoutError(f"job did not finish within {self.timeout_s:.0f} s; stopped everything")
        if self.stop is not None and self.stop.is_set():
            raise JobFailed("stopped on request")



def _due_rejoins(
    client: EtcdClient, keys: JobKeys, progress: Progress, requests: list[InjectionRequest]
) -> list[InjectionRequest]:
    """Those rejoin `requests` not yet carried out whose node is no member and whose step is in
    flight (no etcd read while there is none)."""
    out = []
    statuses: dict[str, InjectionStatus] | None = None
    for req in requests:
        if req.kind != "rejoin" or req.id in progress.rejoined:
            continue
        if statuses is None:
            statuses = read_statuses(client, keys.root)
        if req.id in statuses:
            progress.rejoined.add(req.id)
            continue
        alive, _ = client.get(keys.member(f"node{req.node}"))
        if alive is None and (req.when == "now" or _step_in_flight(client, RunKeys(keys), req.step, progress)):
            out.append(req)
    return out


def _step_in_flight(client: EtcdClient, rk: RunKeys, step: int | None, progress: Progress) -> bool:
    """Whether step `step` (1-based) is in flight or past: step-1 was committed (the progress
    record, one key read, or any record the feed delivered before a checkpoint fallback)."""
    assert step is not None
    if step == 1 or progress.high_water >= step - 1:
        return True
    return committed_steps(client, rk) >= step - 1

