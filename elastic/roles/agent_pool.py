"""The elastic launcher's agent processes: one per node incarnation, started here (forked from
the warm parent, or a fresh interpreter under a placement prefix), and how they stand when the
run ends. Also what stops them and what kills the workers an agent left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from elastic.coordinator.credentials import ETCD_CREDENTIAL_ENVS
from elastic.parallel.phase_clock import DEDICATED_CPU_ENV
from elastic.roles.cpu_quota import CPU_CGROUP_ENV, NodeCpuQuotas
from elastic.roles.exit_codes import EXIT_FENCED
from elastic.roles.launch_errors import JobFailed
from elastic.roles.launcher_feed import Progress
from elastic.roles.launcher_watch import LAUNCHER_PID_ENV
from elastic.roles.static_launcher import POLL_S, STOP_GRACE_S, device_env, log_tail
from elastic.roles.zygote import ZYGOTE_ENV, ZygoteError
from elastic.roles.zygote_client import WarmProcess, ZygoteClient

AgentPlacement = Callable[[int], tuple[list[str], dict[str, str]]]
"""node -> (command prefix, extra environment) of that node's agent process."""


@dataclass
class Agent:
    """One agent process started by the launcher, and its log."""

    node: int
    incarnation: int
    proc: subprocess.Popen[bytes] | WarmProcess
    log: IO[bytes]
    log_path: Path


@dataclass(kw_only=True)
class AgentPool:
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
    agents: list[Agent] = field(default_factory=list)
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
        log = open(log_path, "wb")  # noqa: SIM115 - closed in stop_agents
        if not self.local:
            return
        prefix, extra_env = self.placement(node) if self.placement is not None else ([], {})
        if self.cpu_quotas is not None:
            extra_env = {**extra_env, CPU_CGROUP_ENV: str(self.cpu_quotas.group(node)), DEDICATED_CPU_ENV: "1"}
        env = dict(
            os.environ, ELASTIC_JOB_TOKEN=self.token, OMP_NUM_THREADS=str(self.threads_per_worker),
            **device_env(node, self.gpus_per_node), **extra_env, **{LAUNCHER_PID_ENV: str(os.getpid())},
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
        self.agents.append(Agent(node, incarnation, proc, log, log_path))

    def next_incarnation(self, node: int) -> int:
        """One more than the latest incarnation of `node` started here (0 for none)."""
        return 1 + max((a.incarnation for a in self.agents if a.node == node), default=-1)

    def stop_node(self, node: int) -> None:
        """Stop `node`'s agents that still run."""
        stop_agents([a for a in self.agents if a.node == node and a.proc.poll() is None])

    def fenced(self) -> list[Agent]:
        """The agents that left fenced while their node lived (EXIT_FENCED), each its node's latest."""
        latest = {a.node: a for a in self.agents}
        return [a for a in latest.values() if a.proc.poll() == EXIT_FENCED]

    def all_exited(self) -> bool:
        """Whether agents were started and every one of them has exited."""
        return bool(self.agents) and all(a.proc.poll() is not None for a in self.agents)

    def exit_report(self, steps: int) -> str:
        """Why the run cannot go on once every agent exited: their exit codes, the last one's log."""
        codes = ", ".join(f"node {a.node}.{a.incarnation}: {a.proc.returncode}" for a in self.agents)
        last = self.agents[-1].log_path
        return (
            f"every agent exited before step {steps} was committed (exit codes {codes}); "
            f"last lines of {last}:\n{log_tail(last)}"
        )


def wait_for(cond: Callable[[], bool], timeout: float, what: str, agents: list[Agent]) -> None:
    """Wait until `cond()` holds; JobFailed when one of `agents` exited first, or past `timeout`."""
    deadline = time.monotonic() + timeout
    while not cond():
        dead = [a for a in agents if a.proc.poll() is not None]
        if dead:
            raise JobFailed(f"agent of node {dead[0].node} exited: {log_tail(dead[0].log_path)}")
        if time.monotonic() > deadline:
            raise JobFailed(f"{what} within {timeout:.0f} s")
        time.sleep(POLL_S)


def stop_agents(agents: list[Agent]) -> None:
    """Stop `agents` at once (SIGINT), killing those still there after a grace period; close their logs."""
    for a in agents:
        if a.proc.poll() is None:
            # A hung (stopped) agent cannot act on SIGINT. Through the process object: a forked
            # agent's exit reaches `poll` only once its zygote reports it, and the pid is gone by then.
            a.proc.send_signal(signal.SIGCONT)
            a.proc.send_signal(signal.SIGINT)  # stop at once (SIGTERM would ask for a drain: agent.py)
    deadline = time.monotonic() + STOP_GRACE_S
    for a in agents:
        try:
            a.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            a.proc.kill()
            a.proc.wait()
        a.log.close()


def kill_workers(progress: Progress, *, node: int | None = None) -> None:
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
