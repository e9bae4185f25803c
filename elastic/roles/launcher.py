"""Local launcher: N simulated nodes x G worker processes on this machine.

Two modes. `launch` (fixed plan, no failure handling) is described below. `launch_elastic`
starts etcd (unless given one), writes the job's token-protected config and its `--inject`
faults as injection requests (injection.py), starts one agent per node (elastic.roles.agent:
membership, leader, workers), publishes generation 1, prints each committed step and each
failure and recovery as watches on etcd deliver them (one line per put of the
`progress` key), and counts restarts of survivors' workers from
the PIDs the workers register. It carries out rejoin requests itself: once the node's member is
gone (and the request's step is in flight), any process left of the node's older incarnations
is killed and an agent for the next incarnation is started. It writes the checkpoint manifest
(elastic/records/resume.py) beside the job's checkpoints; a resumed run (`config.resume`,
`elastic run --resume`) publishes generation 1 as a restore of the earlier run's checkpoint. A
stop that saves (`job_stop`, asked by `elastic run`'s first Ctrl-C or SIGTERM, or a stop request
that `elastic drain --all` wrote) ends the run at a step boundary with a checkpoint there
(elastic/roles/job_stop.py): JobStopped. Local agents and etcd run in sessions of their own, so a
terminal's Ctrl-C reaches the launcher alone.

The launcher hosts the rendezvous store (a TCPStore on 127.0.0.1; the store is a parameter so
an etcd-backed one can take its place), writes the job spec, starts one worker subprocess per
(node, local rank), relays rank 0's progress to its own stdout, and watches every worker. It
stops every worker it started when the job ends, when any worker fails (naming that worker and
its exit code) or when it is interrupted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from elastic.coordinator.access import admit
from elastic.coordinator.client import (
    ETCD_CREDENTIAL_ENVS,
    EtcdConfig,
    check_access,
    config_from_env,
    connect,
    etcd_unreachable,
)
from elastic.coordinator.election import current_leader
from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.etcd_server import EtcdCluster, EtcdServer
from elastic.coordinator.generations import Generations
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.parallel.phase_clock import DEDICATED_CPU_ENV
from elastic.records.config import ElasticConfig
from elastic.records.generation import GenerationRecord
from elastic.records.injection import (
    InjectionRequest,
    InjectionStatus,
    read_requests,
    read_statuses,
    submit_request,
    write_status,
)
from elastic.records.job import DEVICE_BASE_ENV, JobSpec
from elastic.records.progress import committed_steps, step_log_path
from elastic.records.resume import ResumeSource
from elastic.records.summary import RunSummary, collect_summary
from elastic.roles.cpu_quota import CPU_CGROUP_ENV, CpuQuotaError, NodeCpuQuotas
from elastic.roles.job_stop import JobStop, JobStopped, StopOutcome, StopTracker
from elastic.roles.progress import (
    JobFeed,
    Progress,
    elastic_summary,
    final_poll,
    poll_progress,
    run_finished,
)
from elastic.roles.zygote import (
    ZYGOTE_ENV,
    WarmProcess,
    ZygoteClient,
    ZygoteError,
    start_process,
    warm_parent,
)

if TYPE_CHECKING:
    import torch.distributed as dist

_POLL_S = 0.05
_READ_EVERY_S = 1.0
"""How often the elastic launcher's loop reads etcd itself (fatal key, rejoin requests, the end)."""
_STOP_GRACE_S = 5.0
_ETCD_STOP_S = 2.0
"""How long the job's own etcd may take to stop gracefully at the end before it is killed: every
write it acknowledged is already on disk, and the history is saved before it stops. Its
graceful stop waits for open streams, and a stopped (SIGSTOPped) client's can hold it for the
full default of 10 s."""


def device_env(node: int, gpus_per_node: int) -> dict[str, str]:
    """The environment that gives `node`'s workers accelerators of their own on a host that runs
    several simulated nodes: node * gpus_per_node onwards (elastic/engine/device.py)."""
    return {DEVICE_BASE_ENV: str(node * gpus_per_node)}


class WorkerFailed(RuntimeError):
    """A worker exited with a non-zero code; every other worker has been stopped."""


@dataclass
class _Worker:
    node: int
    local_rank: int
    proc: subprocess.Popen[bytes] | WarmProcess
    log: IO[bytes]
    log_path: Path


def host_store(*, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """A TCPStore server on 127.0.0.1 at a free port, and that port."""
    import torch.distributed as dist  # here: the elastic launcher starts without torch (zygote.py)

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )
    return store, store.port


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(workers: list[_Worker]) -> None:
    """Stop every still-running worker by PID: SIGTERM, then SIGKILL after a grace period."""
    for w in workers:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_S
    for w in workers:
        remaining = max(0.0, deadline - time.monotonic())
        try:
            w.proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
    for w in workers:
        w.log.close()


def launch(spec: JobSpec, *, quiet: bool = False, timeout_s: float | None = None) -> RunSummary:
    """Run `spec` to completion on local worker processes and return its summary.

    Raises WorkerFailed if a worker exits non-zero, TimeoutError past `timeout_s`.
    """
    run_dir = Path(spec.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "job.json"
    spec.save(spec_path)
    for stale in [spec.result_path, *(spec.stage_state_path(s) for s in range(spec.plan.num_layers))]:
        stale.unlink(missing_ok=True)
    zygote = warm_parent(log=run_dir / "logs" / "zygote.log")  # the workers' warm parent (zygote.py)
    store, port = host_store(timeout_s=spec.collective_timeout_s)
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(spec.threads_per_worker)
    workers: list[_Worker] = []
    start = time.monotonic()
    try:
        for node in sorted(spec.plan.nodes):
            for local_rank in range(spec.plan.gpus_per_node):
                log_path = spec.log_path(node, local_rank)
                log = open(log_path, "wb")  # noqa: SIM115 - closed in _stop
                is_rank0 = spec.plan.locate(node) == (0, 0) and local_rank == 0
                args = ["--spec", str(spec_path), "--node", str(node), "--local-rank", str(local_rank),
                        "--store-port", str(port)]
                proc = start_process("elastic.roles.worker", args, zygote=zygote,
                                     env={**env, **device_env(node, spec.plan.gpus_per_node)},
                                     stdout=None if (is_rank0 and not quiet) else log, stderr=log, warn=_warn)
                workers.append(_Worker(node, local_rank, proc, log, log_path))
        _watch(workers, start=start, timeout_s=timeout_s)
    finally:
        _stop(workers)
        del store
        if zygote is not None:
            zygote.close()
    return collect_summary(spec)


def _warn(what: str) -> None:
    print(f"elastic run: {what}", file=sys.stderr, flush=True)


def _watch(workers: list[_Worker], *, start: float, timeout_s: float | None) -> None:
    pending = list(workers)
    while pending:
        for w in list(pending):
            code = w.proc.poll()
            if code is None:
                continue
            if code != 0:
                raise WorkerFailed(
                    f"worker {w.local_rank} of node {w.node} (pid {w.proc.pid}) exited with code {code}; "
                    f"stopped all other workers. Last lines of {w.log_path}:\n{_tail(w.log_path)}"
                )
            pending.remove(w)
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise TimeoutError(f"job did not finish within {timeout_s:.0f} s; stopped all workers")
        time.sleep(_POLL_S)


# ---- elastic runs: etcd, one agent per node, live reconfiguration --------------------------


AgentPlacement = Callable[[int], tuple[list[str], dict[str, str]]]
"""node -> (command prefix, extra environment) of that node's agent process."""


class JobFailed(RuntimeError):
    """An elastic job could not finish (no progress possible, or the leader gave up)."""


class StartupError(RuntimeError):
    """The job could not start: one line naming what failed and what to check (`elastic run`
    exits 2)."""


EtcdStopHook = Callable[[EtcdClient, JobKeys, str], None]
"""(the launcher's client, the job's keys, the etcd endpoint): what `launch_elastic` runs once
the job's processes are stopped, however the run ended, before the etcd it started stops (e.g.
the CLI's record of the job's history, elastic/cli/run_guard.py). It must not raise."""


@dataclass
class _Agent:
    node: int
    incarnation: int
    proc: subprocess.Popen[bytes] | WarmProcess
    log: IO[bytes]
    log_path: Path


@dataclass(kw_only=True)
class _AgentPool:
    """The agent processes this launcher started for one job: how to start one for a node's
    incarnation, and how they stand (all exited, the last one's log) when the run ends."""

    run_dir: Path
    """Run directory: each agent logs to `logs/agent<node>.inc<incarnation>.log` under it."""
    etcd_endpoint: str
    """host:port of the job's etcd."""
    job: str
    """Job id."""
    token: str
    """The job's access token, handed to each agent in its environment."""
    threads_per_worker: int
    """OMP_NUM_THREADS of each agent (and so of its workers)."""
    gpus_per_node: int
    """Workers per node: node N's workers get accelerators from N * gpus_per_node on (DEVICE_BASE_ENV)."""
    placement: AgentPlacement | None
    """node -> command prefix and extra environment of its agent (None: plain local processes)."""
    local: bool
    """Whether agents are started here at all (False: agents on other hosts join the job)."""
    agents: list[_Agent] = field(default_factory=list)
    """Every agent started so far, in start order."""
    plain_etcd: bool = False
    """The launcher started the job's etcd itself (plain, no auth): the agents do not get the
    ELASTIC_ETCD_* credentials of the environment, which are for an external etcd."""
    zygote: ZygoteClient | None = None
    """The warm parent that agents and their workers are forked from (None: fresh interpreters)."""
    cpu_quotas: NodeCpuQuotas | None = None
    """Each node's cgroup CPU quota (`--node-cpus`), which its agent joins (None: no quota)."""

    def spawn(self, node: int, incarnation: int) -> None:
        """Start the agent of `node`'s `incarnation` (only its log file when agents are not local)."""
        log_path = self.run_dir / "logs" / f"agent{node}.inc{incarnation}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - closed in _stop_agents
        if not self.local:
            return
        prefix, extra_env = self.placement(node) if self.placement is not None else ([], {})
        if self.cpu_quotas is not None:
            extra_env = {**extra_env, CPU_CGROUP_ENV: str(self.cpu_quotas.group(node)), DEDICATED_CPU_ENV: "1"}
        env = dict(
            os.environ, ELASTIC_JOB_TOKEN=self.token, OMP_NUM_THREADS=str(self.threads_per_worker),
            **device_env(node, self.gpus_per_node), **extra_env,
        )
        for var in ETCD_CREDENTIAL_ENVS if self.plain_etcd else ():
            env.pop(var, None)
        args = ["--etcd", self.etcd_endpoint, "--job", self.job, "--node", str(node), "--incarnation", str(incarnation)]
        proc: subprocess.Popen[bytes] | WarmProcess | None = None
        if self.zygote is not None and not prefix:  # a prefix (a network namespace) needs a process of its own
            try:
                proc = self.zygote.spawn("elastic.roles.agent", args, env={**env, ZYGOTE_ENV: self.zygote.path},
                                         stdout=log)
            except ZygoteError as exc:
                print(f"elastic run: {exc}; starting agents cold", file=sys.stderr, flush=True)
                self.zygote = None
        if proc is None:
            env.pop(ZYGOTE_ENV, None)  # its own warm parent, in its own place (a network namespace)
            # a session of its own: a terminal's Ctrl-C reaches the launcher alone, which stops the job
            proc = subprocess.Popen([*prefix, sys.executable, "-m", "elastic.roles.agent", *args],
                                    stdout=log, stderr=log, env=env, start_new_session=True)
        self.agents.append(_Agent(node, incarnation, proc, log, log_path))

    def next_incarnation(self, node: int) -> int:
        """One more than the latest incarnation of `node` started here (0 for none)."""
        return 1 + max((a.incarnation for a in self.agents if a.node == node), default=-1)

    def stop_node(self, node: int) -> None:
        """Stop `node`'s agents that still run."""
        _stop_agents([a for a in self.agents if a.node == node and a.proc.poll() is None])

    def all_exited(self) -> bool:
        """Whether agents were started and every one of them has exited."""
        return bool(self.agents) and all(a.proc.poll() is not None for a in self.agents)

    def exit_report(self, steps: int) -> str:
        """Why the run cannot go on once every agent exited: their exit codes, the last one's log."""
        codes = ", ".join(f"node {a.node}.{a.incarnation}: {a.proc.returncode}" for a in self.agents)
        last = self.agents[-1].log_path
        return (
            f"every agent exited before step {steps} was committed (exit codes {codes}); "
            f"last lines of {last}:\n{_tail(last)}"
        )


@dataclass(kw_only=True)
class _RunLoop:
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
    pool: _AgentPool
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
    started_at: float = 0.0
    """Wall time of the launch (the origin of a stopped run's summary)."""
    _stopping: StopTracker = field(init=False)
    _stopped: StopOutcome | None = field(init=False, default=None)

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
                for req in _due_rejoins(self.client, self.keys, self.progress, requests):
                    self._rejoin(req)
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
            time.sleep(_POLL_S)
        if self._stopped is not None:
            final_poll(self.client, self.keys, self.config, self.progress, self.say, self.feed)
            raise JobStopped(self._stopped, elastic_summary(self.config, self.progress, started_at=self.started_at))

    def poll(self) -> None:
        """Take in what the feed delivered (prints step, failure and recovery lines)."""
        poll_progress(self.client, self.keys, self.config, self.progress, self.say, self.feed)

    def _read_requests(self) -> list[InjectionRequest]:
        """The job's injection requests; JobFailed if the leader gave up (its `fatal` key)."""
        fatal, _ = self.client.get(self.keys.fatal)
        if fatal is not None:
            raise JobFailed(f"the leader gave up: {fatal.decode()}")
        return read_requests(self.client, self.keys.root)

    def _rejoin(self, req: InjectionRequest) -> None:
        """Carry out one due rejoin: end what is left of the node, start its next incarnation."""
        self.progress.rejoined.add(req.id)
        self.client.put(RunKeys(self.keys).injected(req.id), repr(time.time()))
        incarnation = self.pool.next_incarnation(req.node)
        self.pool.stop_node(req.node)
        _kill_workers(self.progress, node=req.node)
        self.say(f"elastic run: node {req.node} rejoins (incarnation {incarnation})")
        self.pool.spawn(req.node, incarnation)
        status = InjectionStatus(state="done", at=time.time(), detail=f"incarnation {incarnation} started")
        write_status(self.client, self.keys.root, req.id, status)

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
        """TimeoutError past the run's time limit, JobFailed once stopped on request."""
        if self.timeout_s is not None and time.monotonic() - self.start > self.timeout_s:
            raise TimeoutError(f"job did not finish within {self.timeout_s:.0f} s; stopped everything")
        if self.stop is not None and self.stop.is_set():
            raise JobFailed("stopped on request")


def _start_etcd(run_dir: Path, members: int) -> EtcdServer | EtcdCluster:
    """The launcher's own etcd: one server, or a local cluster of `members` members; StartupError
    (one line) if it does not start."""
    try:
        if members > 1:
            return EtcdCluster(members, data_dir=run_dir / "etcd").start()
        return EtcdServer(data_dir=run_dir / "etcd").start()
    except (OSError, RuntimeError, TimeoutError) as exc:  # no binary, it exited, or never healthy
        raise StartupError(f"the job's own etcd did not start: {exc}") from None


def launch_elastic(
    config: ElasticConfig,
    *,
    etcd_endpoint: str | None = None,
    quiet: bool = False,
    timeout_s: float | None = None,
    job: str | None = None,
    token: str | None = None,
    placement: AgentPlacement | None = None,
    local_agents: bool = True,
    stop: threading.Event | None = None,
    job_stop: JobStop | None = None,
    etcd_members: int = 1,
    before_etcd_stops: EtcdStopHook | None = None,
    node_cpus: float | None = None,
) -> RunSummary:
    """Run `config` with an agent per node (module doc of elastic.roles.agent) and return its summary.

    Starts an etcd server (a local cluster of `etcd_members` members when more than 1: its
    endpoint list is printed and written to job.json) unless `etcd_endpoint` (`HOST:PORT[,...]`)
    is given. `job` and `token` default to fresh random ones. `placement(node)` gives a command
    prefix and extra environment for that node's agent (e.g. `ip netns exec NS` and ELASTIC_HOST,
    see deploy/); with `local_agents=False` no agent is started here: agents on other hosts
    (`python -m elastic.roles.agent`) join the job. `node_cpus` caps each local node at that many
    cores (elastic/roles/cpu_quota.py). `stop` (set from another thread) ends the run with
    JobFailed, `job_stop` (asked by a signal handler) with JobStopped at a step boundary, its
    checkpoint complete (StopTimedOut past its grace). Raises JobFailed or TimeoutError; every
    process it started (etcd, agents, their workers) is stopped by PID on the way out, then
    `before_etcd_stops` runs (EtcdStopHook).
    StartupError, EtcdUnreachableError: no start."""
    started_at, spec, run_dir = time.time(), config.spec, Path(config.spec.run_dir)
    job = job or f"run-{secrets.token_hex(4)}"
    if etcd_endpoint is not None:  # an external etcd: a credential it refuses stops the run before anything is written
        check_access(config_from_env(etcd_endpoint), key=JobKeys(job).root, require=True).close()
    quotas, zygote, server = _start_services(config, etcd_endpoint=etcd_endpoint, etcd_members=etcd_members,
                                             warm=local_agents and placement is None,
                                             node_cpus=node_cpus if local_agents else None, job=job)
    etcd_endpoint = server.endpoint if server is not None else etcd_endpoint
    assert etcd_endpoint is not None
    token = token or secrets.token_hex(16)
    pool = _AgentPool(run_dir=run_dir, etcd_endpoint=etcd_endpoint, job=job, token=token,
                      threads_per_worker=spec.threads_per_worker, gpus_per_node=spec.plan.gpus_per_node,
                      placement=placement, local=local_agents,
                      plain_etcd=server is not None, zygote=zygote, cpu_quotas=quotas)
    progress = Progress()
    client = connect(config_from_env(etcd_endpoint) if server is None else EtcdConfig(endpoint=etcd_endpoint))
    keys = JobKeys(job)
    feeds: list[JobFeed] = []
    start = time.monotonic()

    def say(line: str) -> None:
        if not quiet:
            print(line, flush=True)

    try:
        admit(client, keys, token)
        feed = JobFeed(client, RunKeys(keys))  # before anything is written: every step, plan and worker is seen
        feeds.append(feed)
        _submit_job(client, keys, config, etcd=etcd_endpoint, token=token)
        _start_job(client, keys, spec, pool, resume=config.resume, spares=config.spares)
        _announce(say, config, job=job, etcd=etcd_endpoint)
        loop = _RunLoop(config=config, client=client, keys=keys, feed=feed, progress=progress, pool=pool, say=say,
                        start=start, timeout_s=timeout_s, stop=stop, job_stop=job_stop, started_at=started_at)
        loop.follow()
        final_poll(client, keys, config, progress, say, feed)
        return elastic_summary(config, progress, started_at=started_at)
    finally:
        _stop_agents(pool.agents)
        _kill_workers(progress)
        if zygote is not None:
            zygote.close()
        if quotas is not None:
            quotas.close()
        for f in feeds:
            f.close()
        _close_client(client, keys, etcd_endpoint, before_etcd_stops)  # its hook first, with etcd still up
        if server is not None:
            server.stop(timeout=_ETCD_STOP_S)


def _announce(say: Callable[[str], None], config: ElasticConfig, *, job: str, etcd: str) -> None:
    """The job's first lines: its spares, where it runs, what it resumes."""
    if config.spares:
        first = max(config.spec.plan.nodes) + 1
        say(f"elastic run: {config.spares} hot spare(s) up: node(s) {list(range(first, first + config.spares))}")
    say(f"elastic run: job {job}, etcd {etcd}, {len(config.spec.plan.nodes)} agents, generation 1 published")
    if config.resume is not None:
        say(f"elastic run: {config.resume.describe()}")


def _start_services(
    config: ElasticConfig, *, etcd_endpoint: str | None, etcd_members: int, warm: bool, node_cpus: float | None,
    job: str,
) -> tuple[NodeCpuQuotas | None, ZygoteClient | None, EtcdServer | EtcdCluster | None]:
    """The nodes' CPU quotas (`node_cpus`), the run directory's files, the warm parent of the local
    agents and workers (`warm`; its imports run while etcd starts) and the job's own etcd (None:
    `etcd_endpoint`'s). Nothing is left behind when one of them fails."""
    spec = config.spec
    run_dir = Path(spec.run_dir)
    try:
        quotas = NodeCpuQuotas(cpus=node_cpus, job=job) if node_cpus is not None else None
    except CpuQuotaError as exc:
        raise StartupError(f"--node-cpus: {exc}") from None
    zygote = None
    try:
        _clear_run_dir(spec)
        zygote = warm_parent(log=run_dir / "logs" / "zygote.log") if warm else None
        spec.save(run_dir / "spec.json")  # what `elastic export` and `elastic sample` read (ops/run_state.py)
        _prepare_checkpoints(config)
        server = _start_etcd(run_dir, etcd_members) if etcd_endpoint is None else None
    except BaseException:
        if zygote is not None:
            zygote.close()
        if quotas is not None:
            quotas.close()
        raise
    return quotas, zygote, server


def _close_client(client: EtcdClient, keys: JobKeys, endpoint: str, hook: EtcdStopHook | None) -> None:
    """Run `hook` (the job's processes are stopped, its etcd still up), then close the launcher's client."""
    if hook is not None:
        hook(client, keys, endpoint)
    client.close()


def _clear_run_dir(spec: JobSpec) -> None:
    """Create the run directory's `logs/` and delete what a previous run left that this run writes
    (results, final plan, stage states, step logs: they would enter this run's summary)."""
    run_dir = Path(spec.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for stale in [spec.result_path, run_dir / "final_plan.json",
                  *(spec.stage_state_path(s) for s in range(spec.plan.num_layers)),
                  *step_log_path(run_dir, 0, 0).parent.glob("*.jsonl")]:
        stale.unlink(missing_ok=True)  # a previous run's step logs would enter this run's summary


def _submit_job(client: EtcdClient, keys: JobKeys, config: ElasticConfig, *, etcd: str, token: str) -> None:
    """Write the job file of the run directory, the job's config and its injection requests."""
    write_job_file(Path(config.spec.run_dir), etcd=etcd, job=keys.job, token=token)
    client.put(RunKeys(keys).config, config.to_json())
    for inj in config.injections:
        submit_request(client, keys.root, InjectionRequest.from_injection(inj))


def _prepare_checkpoints(config: ElasticConfig) -> None:
    """Write the manifest beside the run's checkpoints (what a later `--resume` checks), and when
    a resumed run writes into the checkpoint directory it resumes from, set aside the steps newer
    than its start (incomplete or corrupt ones it skipped): they would mix with the steps it writes."""
    if config.checkpoint_every <= 0:
        return
    from elastic.engine.checkpoint_files import list_steps, step_dir
    from elastic.records.resume import CheckpointManifest

    spec, directory = config.spec, Path(config.checkpoint_path)
    CheckpointManifest(model=spec.model, model_config=spec.model_config, global_batch=spec.plan.global_batch,
                       data_seed=spec.data_seed, data_path=spec.data_path, optim=spec.optim).save(directory)
    resume = config.resume
    if resume is None or Path(resume.checkpoint_dir).resolve() != directory.resolve():
        return
    aside = directory / f"set-aside-{time.strftime('%Y%m%d-%H%M%S')}"
    for step in list_steps(directory):
        if step > resume.step:
            aside.mkdir(exist_ok=True)
            os.rename(step_dir(directory, step), aside / step_dir(directory, step).name)
            print(f"elastic run: moved the checkpoint of step {step} (newer than the resumed step {resume.step}) "
                  f"to {aside}", file=sys.stderr, flush=True)


def _start_job(client: EtcdClient, keys: JobKeys, spec: JobSpec, pool: _AgentPool, *,
               resume: ResumeSource | None = None, spares: int = 0) -> None:
    """Start the agents (the first node's alone until it leads), wait for every worker to
    register, and publish generation 1 (which restores `resume`'s checkpoint when given).
    `spares` more agents (nodes after the plan's) start beside them and are up, registered, when
    generation 1 is published without them: the job's hot spares (elastic/planning/spares.py)."""
    nodes = sorted(spec.plan.nodes)
    pool.spawn(nodes[0], 0)  # the first node's agent becomes the leader: leader-failure runs can target it
    join_s = 1.0 if pool.local else 30.0  # external agents: pods and hosts take their time to start
    _wait_for(lambda: current_leader(client, keys) is not None, 60.0 * join_s, "no leader elected", pool.agents)
    for node in nodes[1:]:
        pool.spawn(node, 0)
    for node in range(nodes[-1] + 1, nodes[-1] + 1 + spares):  # hot spares: up before generation 1
        pool.spawn(node, 0)
    world = (len(nodes) + spares) * spec.plan.gpus_per_node
    workers = RunKeys(keys).workers
    _wait_for(lambda: _count(client, workers) >= world, 120.0 * join_s, "workers did not register", pool.agents)
    first = GenerationRecord(plan=spec.plan, resume_step=0, incarnations=dict.fromkeys(nodes, 0),
                             published_at=time.time())
    if resume is not None:
        first = dataclasses.replace(first, resume_step=resume.step, restore_checkpoint=resume.step,
                                    restore_dir=resume.checkpoint_dir, reason=resume.describe())
    Generations(client, keys).publish(first.to_json(), expected=0)


JOB_FILE = "job.json"


def write_job_file(run_dir: Path, *, etcd: str, job: str, token: str) -> Path:
    """Write `<run_dir>/job.json` ({"etcd", "etcd_endpoints", "job", "token"}, mode 0600): how the
    operator CLI (`elastic status --run-dir`, `elastic inject`, ...) finds a running local job.
    `etcd` is the endpoint list as `--etcd` takes it (what older readers read), `etcd_endpoints`
    the same list as a JSON list.

    Written to a temporary file and renamed into place, so a reader never sees it half written."""
    path = run_dir / JOB_FILE
    tmp = run_dir / f".{JOB_FILE}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        record: dict[str, Any] = {"etcd": etcd, "job": job, "token": token}
        record["etcd_endpoints"] = [m.strip() for m in etcd.split(",")]  # ha: the list, for readers that want one
        json.dump(record, out)
    os.replace(tmp, path)
    return path


def _wait_for(cond: Callable[[], bool], timeout: float, what: str, agents: list[_Agent]) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        dead = [a for a in agents if a.proc.poll() is not None]
        if dead:
            raise JobFailed(f"agent of node {dead[0].node} exited: {_tail(dead[0].log_path)}")
        if time.monotonic() > deadline:
            raise JobFailed(f"{what} within {timeout:.0f} s")
        time.sleep(_POLL_S)


def _count(client: EtcdClient, prefix: str) -> int:
    """Keys under `prefix` (etcd counts them; no key is returned)."""
    return int(client.get_prefix_response(prefix, count_only=True).count)


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


def _stop_agents(agents: list[_Agent]) -> None:
    for a in agents:
        if a.proc.poll() is None:
            os.kill(a.proc.pid, signal.SIGCONT)  # a hung (stopped) agent cannot act on SIGINT
            a.proc.send_signal(signal.SIGINT)  # stop at once (SIGTERM would ask for a drain: agent.py)
    deadline = time.monotonic() + _STOP_GRACE_S
    for a in agents:
        try:
            a.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            a.proc.kill()
            a.proc.wait()
        a.log.close()


def _kill_workers(progress: Progress, *, node: int | None = None) -> None:
    """SIGKILL any worker an agent left behind (a hung node's stopped workers), by registered PID;
    only `node`'s when given."""
    import psutil

    for (n, _, _), pids in progress.pids.items():
        if node is not None and n != node:
            continue
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                if any("elastic.roles.elastic_worker" in part for part in proc.cmdline()):
                    proc.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
