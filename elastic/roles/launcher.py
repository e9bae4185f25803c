"""Elastic launcher: `launch_elastic` runs a job with one agent per node, on this machine or
beside agents on other hosts (the static launcher of a fixed plan is static_launcher.py).

It starts etcd (unless given one), writes the job's token-protected config and its `--inject`
faults as injection requests (records/injection_requests.py), starts one agent per node (elastic.roles.agent:
membership, leader, workers; the pool of agent_pool.py), publishes generation 1, then follows the
run (run_loop.py): it prints each committed step and each failure and recovery as watches on etcd
deliver them (one line per put of the `progress` key), counts restarts of survivors' workers from
the PIDs the workers register, and carries out rejoin requests itself. It writes the checkpoint
manifest (elastic/records/resume.py) beside the job's checkpoints; a resumed run (`config.resume`,
`elastic run --resume`) publishes generation 1 as a restore of the earlier run's checkpoint. A
stop that saves (`job_stop`, asked by `elastic run`'s first Ctrl-C or SIGTERM, or a stop request
that `elastic drain --all` wrote) ends the run at a step boundary with a checkpoint there
(elastic/roles/job_stop.py): JobStopped. Local agents and etcd run in sessions of their own, so a
terminal's Ctrl-C reaches the launcher alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic.coordinator.access import admit
from elastic.coordinator.client import EtcdConfig, connect
from elastic.coordinator.credentials import check_access, config_from_env
from elastic.coordinator.election import current_leader
from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.etcd_cluster import EtcdCluster
from elastic.coordinator.etcd_server import EtcdServer
from elastic.coordinator.generations import Generations
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.records.config import ElasticConfig
from elastic.records.generation import GenerationRecord
from elastic.records.injection_requests import InjectionRequest, submit_request
from elastic.records.job import JobSpec
from elastic.records.node_workers import read_registrations
from elastic.records.progress import step_log_path
from elastic.records.resume import ResumeSource
from elastic.records.summary import RunSummary
from elastic.roles.agent_pool import AgentPlacement, AgentPool, kill_workers, stop_agents, wait_for
from elastic.roles.cpu_quota import CpuQuotaError, NodeCpuQuotas
from elastic.roles.interrupt import Interrupt
from elastic.roles.job_stop import JobStop
from elastic.roles.launch_errors import StartupError
from elastic.roles.launcher_feed import JobFeed, Progress, elastic_summary, final_poll
from elastic.roles.run_loop import RunLoop
from elastic.roles.zygote_client import ZygoteClient, warm_parent

_ETCD_STOP_S = 2.0
"""How long the job's own etcd may take to stop gracefully at the end before it is killed: every
write it acknowledged is already on disk, and the history is saved before it stops. Its
graceful stop waits for open streams, and a stopped (SIGSTOPped) client's can hold it for the
full default of 10 s."""


EtcdStopHook = Callable[[EtcdClient, JobKeys, str], None]
"""(the launcher's client, the job's keys, the etcd endpoint): what `launch_elastic` runs once
the job's processes are stopped, however the run ended, before the etcd it started stops (e.g.
the CLI's record of the job's history, elastic/cli/run_guard.py). It must not raise."""



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
    rejoin_fenced: int = 0,
    interrupt: Interrupt | None = None,
) -> RunSummary:
    """Run `config` with an agent per node (module doc of elastic.roles.agent) and return its summary.

    Starts an etcd server (a local cluster of `etcd_members` members when more than 1: its
    endpoint list is printed and written to job.json) unless `etcd_endpoint` (`HOST:PORT[,...]`)
    is given. `job` and `token` default to fresh random ones. `placement(node)` gives a command
    prefix and extra environment for that node's agent (e.g. `ip netns exec NS` and ELASTIC_HOST,
    see deploy/); with `local_agents=False` no agent is started here: agents on other hosts
    (`python -m elastic.roles.agent`) join the job. `node_cpus` caps each local node at that many
    cores (elastic/roles/cpu_quota.py); a fenced local node is started again up to `rejoin_fenced` times. `stop` (set from another thread) ends the run with
    JobFailed, `job_stop` (asked by a signal handler) with JobStopped at a step boundary, its
    checkpoint complete (StopTimedOut past its grace), `interrupt` (asked by a signal handler: a
    stop at once, elastic/roles/interrupt.py) with Interrupted. Raises JobFailed or TimeoutError; every
    process it started (etcd, agents, their workers) is stopped by PID on the way out, then
    `before_etcd_stops` runs (EtcdStopHook).
    StartupError, EtcdUnreachableError: no start."""
    interrupt = interrupt if interrupt is not None else Interrupt()
    with interrupt.deferred():  # a signal now only asks: interrupt.py
        started_at, spec, run_dir = time.time(), config.spec, Path(config.spec.run_dir)
        job = job or f"run-{secrets.token_hex(4)}"
        quotas, zygote, server = _start_services(config, etcd_endpoint=etcd_endpoint, etcd_members=etcd_members,
                                                 warm=local_agents and placement is None,
                                                 node_cpus=node_cpus if local_agents else None, job=job)
        etcd_endpoint = server.endpoint if server is not None else etcd_endpoint
        assert etcd_endpoint is not None
        token = token or secrets.token_hex(16)
        pool = AgentPool(run_dir=run_dir, etcd_endpoint=etcd_endpoint, job=job, token=token,
                         threads_per_worker=spec.threads_per_worker, gpus_per_node=spec.plan.gpus_per_node,
                         placement=placement, local=local_agents,
                         plain_etcd=server is not None, zygote=zygote, cpu_quotas=quotas)
        progress = Progress()
        client = connect(config_from_env(etcd_endpoint) if server is None else EtcdConfig(endpoint=etcd_endpoint))
        keys = JobKeys(job)
        feeds: list[JobFeed] = []
        start = time.monotonic()

        say = _printer(quiet)
        try:
            interrupt.check()
            admit(client, keys, token)
            feed = JobFeed(client, RunKeys(keys))  # before anything is written: every step, plan and worker is seen
            feeds.append(feed)
            _submit_job(client, keys, config, etcd=etcd_endpoint, token=token, etcd_pids=_etcd_pids(server))
            _start_job(client, keys, spec, pool, resume=config.resume, spares=config.spares, interrupt=interrupt)
            _announce(say, config, job=job, etcd=etcd_endpoint)
            interrupt.check()
            loop = RunLoop(config=config, client=client, keys=keys, feed=feed, progress=progress, pool=pool, say=say,
                           start=start, timeout_s=timeout_s, stop=stop, job_stop=job_stop, interrupt=interrupt,
                           started_at=started_at,
                           rejoin_fenced=rejoin_fenced if local_agents else 0)
            loop.follow()
            final_poll(client, keys, config, progress, say, feed)
            summary = elastic_summary(config, progress, started_at=started_at)
        finally:
            stop_agents(pool.agents)
            kill_workers(progress)
            _stop_services(quotas, zygote, feeds)
            _close_client(client, keys, etcd_endpoint, before_etcd_stops)  # its hook first, with etcd still up
            if server is not None:
                server.stop(timeout=_ETCD_STOP_S)
    return summary


def _printer(quiet: bool) -> Callable[[str], None]:
    """Prints one line for people, or nothing when `quiet`."""

    def say(line: str) -> None:
        if not quiet:
            print(line, flush=True)

    return say


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
    if etcd_endpoint is not None:  # an external etcd: a credential it refuses stops the run before anything is written
        check_access(config_from_env(etcd_endpoint), key=JobKeys(job).root, require=True).close()
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


def _stop_services(quotas: NodeCpuQuotas | None, zygote: ZygoteClient | None, feeds: list[JobFeed]) -> None:
    """Close what `_start_services` started (its etcd aside) and the launcher's feeds."""
    if zygote is not None:
        zygote.close()
    if quotas is not None:
        quotas.close()
    for f in feeds:
        f.close()


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


def _etcd_pids(server: EtcdServer | EtcdCluster | None) -> list[int]:
    """The PIDs of the etcd the launcher started (member order), for `elastic inject etcd-stall`."""
    if server is None:
        return []
    members = server.members if isinstance(server, EtcdCluster) else [server]
    return [pid for m in members if (pid := m.pid) is not None]


def _submit_job(client: EtcdClient, keys: JobKeys, config: ElasticConfig, *, etcd: str, token: str,
                etcd_pids: list[int] | None = None) -> None:
    """Write the job file of the run directory, the job's config and its injection requests."""
    write_job_file(Path(config.spec.run_dir), etcd=etcd, job=keys.job, token=token, etcd_pids=etcd_pids)
    client.put(RunKeys(keys).config, config.to_packed())
    for inj in config.injections:
        submit_request(client, keys.root, InjectionRequest.from_injection(inj))


def _prepare_checkpoints(config: ElasticConfig) -> None:
    """Write the manifest beside the run's checkpoints (what a later `--resume` checks), and when
    a resumed run writes into the checkpoint directory it resumes from, set aside the steps newer
    than its start (incomplete or corrupt ones it skipped): they would mix with the steps it writes."""
    if config.checkpoint_every <= 0:
        return
    from elastic.engine.checkpoint.files import list_steps, step_dir
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


def _start_job(client: EtcdClient, keys: JobKeys, spec: JobSpec, pool: AgentPool, *,
               resume: ResumeSource | None = None, spares: int = 0, interrupt: Interrupt) -> None:
    """Start the agents (the first node's alone until it leads), wait for every worker to
    register, and publish generation 1 (which restores `resume`'s checkpoint when given).
    `spares` more agents (nodes after the plan's) start beside them and are up, registered, when
    generation 1 is published without them: the job's hot spares (elastic/planning/spares.py).
    Interrupted once `interrupt` is asked meanwhile."""
    rk = RunKeys(keys)
    world = (len(spec.plan.nodes) + spares) * spec.plan.gpus_per_node

    def led() -> bool:
        interrupt.check()
        return current_leader(client, keys) is not None

    def registered() -> bool:
        interrupt.check()
        return len(read_registrations(client, rk)) >= world

    nodes = sorted(spec.plan.nodes)
    pool.spawn(nodes[0], 0)  # the first node's agent becomes the leader: leader-failure runs can target it
    join_s = 1.0 if pool.local else 30.0  # external agents: pods and hosts take their time to start
    wait_for(led, 60.0 * join_s, "no leader elected", pool.agents)
    for node in nodes[1:]:
        pool.spawn(node, 0)
    for node in range(nodes[-1] + 1, nodes[-1] + 1 + spares):  # hot spares: up before generation 1
        pool.spawn(node, 0)
    wait_for(registered, 120.0 * join_s, "workers did not register", pool.agents)
    first = GenerationRecord(plan=spec.plan, resume_step=0, incarnations=dict.fromkeys(nodes, 0),
                             published_at=time.time())
    if resume is not None:
        first = dataclasses.replace(first, resume_step=resume.step, restore_checkpoint=resume.step,
                                    restore_dir=resume.checkpoint_dir, reason=resume.describe())
    Generations(client, keys).publish(first.to_json(), expected=0)


JOB_FILE = "job.json"


def write_job_file(run_dir: Path, *, etcd: str, job: str, token: str, etcd_pids: list[int] | None = None) -> Path:
    """Write `<run_dir>/job.json` ({"etcd", "etcd_endpoints", "job", "token"}, and "etcd_pids" of
    the etcd it started itself, member order; mode 0600): how the
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
        if etcd_pids:
            record["etcd_pids"] = etcd_pids  # `elastic inject etcd-stall` signals these
        json.dump(record, out)
    os.replace(tmp, path)
    return path


