"""Node agent: `python -m elastic.roles.agent --etcd HOST:PORT --job J --node N --incarnation I`.

One per node. It joins the job's membership with a lease, campaigns for leader (running
`Leader` while elected), spawns the node's G elastic workers (once: a survivor's workers are
never restarted) and watches them: a worker that exits before finishing, or that is found
stopped (SIGSTOP: hung), makes it report the node failed at once (its lease is revoked, every
watcher sees the loss), kill the node's other workers and exit.

It carries out the injection requests (records/injection_requests.py) addressed to its node and incarnation,
watching `injections/` (elastic/roles/agent_injections.py): kill (SIGKILL the workers), hang
(SIGSTOP workers and agent: the lease expires), slow (a SIGSTOP/SIGCONT duty cycle on the
workers, which the hang detector knows is not a hang) and partition (emulated: keepalives stop,
the leader steps down and the workers are SIGSTOPped for the given seconds; after the heal the
node finds itself fenced, kills its workers before they run again and exits 5, EXIT_FENCED). An
agent that finds its own lease expired and its place not kept (a real partition healed, a hang
continued) likewise kills its workers and exits 5 (3 when etcd stayed out of reach); `elastic run
--rejoin-fenced N` starts such a node's next incarnation (elastic/roles/run_loop.py).

Preemption (elastic/roles/agent_preemption.py): SIGTERM (Kubernetes' and SLURM's notice, or
torchrun passing its own on) asks the leader for a drain of this node, as `elastic drain` does
(a request under `injections/`, by "sigterm"). When the leader meets it, the node leaves at the next step boundary with nothing
discarded: its workers hand their shards over and the agent exits 0. When the leader refuses it
(the other nodes could not form the job's f+1 pipelines) or it is not done within
$ELASTIC_PREEMPT_GRACE_S (default 20 s, below Kubernetes' default grace of 30 s), the node leaves
as a failure, exit 3. SIGINT (Ctrl-C, or the local launcher stopping its job) stops the node at
once, exit 3 (the local launcher starts agents in sessions of their own: a terminal's Ctrl-C
reaches the launcher, which stops the whole job with a checkpoint first, elastic/records/stop.py).

Exit codes: 0 when its workers finished the job (or were drained), 3 when the node failed, 4 when the job token was refused. The
job token comes in the ELASTIC_JOB_TOKEN environment variable.

Under torchrun (`torchrun --rdzv-backend=elastic-etcd ... -m elastic.roles.agent`, see
deploy/) the flags may be left out: the agent takes etcd, job, node and incarnation from the
ELASTIC_* variables the rendezvous sets (the rendezvous node id must be `node<N>`), waits for
the job's config to be published, and adopts the member registration the rendezvous made.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from elastic.coordinator.access import JobAccessError, admit
from elastic.coordinator.client import connect, stop_retrying
from elastic.coordinator.credentials import config_from_env
from elastic.coordinator.election import LeaderElection
from elastic.coordinator.events import record_event
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.coordinator.membership import Membership, MembershipConfig, NodeIdentity
from elastic.coordinator.monitor import WorkerMonitor
from elastic.coordinator.probe import ProbeServer
from elastic.coordinator.store_relay import STORE_RELAY_ENV, STORE_RELAY_SWITCH, StoreRelay
from elastic.coordinator.watch import watch_from_now
from elastic.records.config import ElasticConfig
from elastic.records.node_workers import read_registrations
from elastic.records.proc_stat import process_state
from elastic.records.workers import WorkerInfo, node_id, node_of
from elastic.roles import cpu_quota
from elastic.roles.agent_injections import NodeInjections
from elastic.roles.agent_preemption import PREEMPT_GRACE_ENV, PREEMPT_GRACE_S, Preemption
from elastic.roles.agent_rejoin import campaign_again, keep_place
from elastic.roles.exit_codes import EXIT_FAILED, EXIT_FENCED, EXIT_REFUSED
from elastic.roles.launcher_watch import LAUNCHER_PID_ENV, watch_launcher
from elastic.roles.node_relay import RELAY_ENV, NodeRelay
from elastic.roles.start_phases import process_start_time, start_phases
from elastic.roles.zygote import FORKED_AT_ENV, SPAWNED_AT_ENV
from elastic.roles.zygote_client import WarmProcess, start_process, warm_parent

if TYPE_CHECKING:
    from elastic.ops.metrics import NodeMetrics
    from elastic.roles.leader import Leader

TOKEN_ENV = "ELASTIC_JOB_TOKEN"
AGENT_PID_ENV = "ELASTIC_AGENT_PID"
RDZV_ROUND_ENV = "ELASTIC_RDZV_ROUND"
"""Set by the elastic-etcd rendezvous: this agent runs under torchrun, which registered the node."""
CONFIG_WAIT_S = 1800.0
"""Under torchrun: how long to wait for the controller to publish the job's config."""
ETCD_GIVE_UP_ENV = "ELASTIC_ETCD_GIVE_UP_S"
ETCD_GIVE_UP_S = 300.0
"""How long etcd may stay unreachable before the agent counts its node lost, stops its workers
and exits (EXIT_FAILED); $ELASTIC_ETCD_GIVE_UP_S overrides it. etcd extends every lease when it
comes back, so shorter outages cost nothing."""
_STOPPED_CHECK_S = 0.1
_SIGNAL_SLICE_S = 0.1
"""Longest the main thread sleeps before it runs a pending signal's handler (`run`)."""
_START_RECORD_S = 120.0

log = logging.getLogger("elastic.agent")


def worker_log_path(run_dir: str, node: int, local_rank: int, incarnation: int) -> Path:
    return Path(run_dir) / "logs" / f"node{node}.worker{local_rank}.inc{incarnation}.log"


class Agent:
    """One node's agent (see the module doc)."""

    def __init__(self, *, endpoint: str, job: str, node: int, incarnation: int, token: str) -> None:
        self.endpoint, self.node, self.incarnation, self.token = endpoint, node, incarnation, token
        self.started_at = process_start_time()  # a fresh interpreter's imports count too
        # The warm parent of this node's workers: the local launcher's (its socket in
        # $ELASTIC_ZYGOTE), else one of our own, whose imports run while we join the job.
        self.zygote = warm_parent()
        self.client = connect(config_from_env(endpoint))
        self.keys = JobKeys(job)
        self.rk = RunKeys(self.keys)
        admit(self.client, self.keys, token or None)
        value, _ = self.client.get(self.rk.config)
        deadline = time.monotonic() + (CONFIG_WAIT_S if os.environ.get(RDZV_ROUND_ENV) else 0.0)
        while value is None and time.monotonic() < deadline:  # the controller may start after the nodes
            time.sleep(1.0)
            value, _ = self.client.get(self.rk.config)
        if value is None:
            raise SystemExit(f"job {job} has no config in etcd at {endpoint}")
        self.config = ElasticConfig.from_json(value)
        spec = self.config.spec
        self.gpus, self.run_dir, self.threads = spec.plan.gpus_per_node, str(spec.run_dir), spec.threads_per_worker
        ttl = self.config.lease_ttl
        self.who = node_id(node)
        self.procs: dict[int, subprocess.Popen[bytes] | WarmProcess] = {}
        self.exit_code: int | None = None
        self.injections = NodeInjections(self)
        """The fault injections addressed to this node incarnation."""
        self.probe = ProbeServer(self._probe_answer).start()
        """Answers the leader's liveness probe (the second witness of a lease expiry) at the member's address."""
        identity = NodeIdentity(node_id=self.who, incarnation=incarnation, address=self.probe.address,
                                devices=self.gpus)
        try:
            give_up = float(os.environ.get(ETCD_GIVE_UP_ENV, ETCD_GIVE_UP_S))
        except ValueError:
            raise SystemExit(f"${ETCD_GIVE_UP_ENV} must be seconds, got {os.environ[ETCD_GIVE_UP_ENV]!r}") from None
        self.membership = Membership(self.client, self.keys, identity,
                                     config=MembershipConfig(ttl=ttl, give_up_s=give_up),
                                     on_self_lost=self._on_lease_lost)
        self.election = LeaderElection(self.client, self.keys, self.who, ttl=ttl, on_lost=self._recampaign)
        self.done = threading.Event()
        self.lock = threading.Lock()
        """Held while the node's fate is decided (finished, failed, fenced)."""
        self._finished: set[int] = set()
        self.preemption = Preemption(self)
        """What a SIGTERM does: ask for a drain of this node."""
        self.monitor: WorkerMonitor | None = None
        self.metrics: NodeMetrics | None = None
        self.leader: Leader | None = None
        self.relay: NodeRelay | None = None
        self.store_relay: StoreRelay | None = None
        """Writes what this node's workers report at a generation change as one transaction."""
        self.cpu_group = os.environ.get(cpu_quota.CPU_CGROUP_ENV, "")
        """The node's cgroup CPU quota (`elastic run --node-cpus`): its workers (and the throttle's
        burners) run in it; the agent itself stays out, as a node's host CPU is not its device."""

    # ---- life cycle ----------------------------------------------------------------------

    def run(self) -> int:
        if os.environ.get(RDZV_ROUND_ENV):
            self.membership.adopt()
        else:
            self.membership.join()
        # Outlives the lease: a leader elected after an etcd stall (every member key gone) still
        # finds where to probe this node.
        self.client.put(self.keys.probe(self.who, self.incarnation), self.probe.address)
        self._start_metrics()
        trigger = self.injections.open()
        self._spawn_workers()
        self.monitor = WorkerMonitor(list(self.procs), self._on_death)
        from elastic.roles.leader import Leader

        self.election.start()
        self.leader = Leader(self.client, self.keys, self.config, self.election, who=self.who).start()
        threading.Thread(target=self._watch_stopped, name="stopped-check", daemon=True).start()
        requests = watch_from_now(self.client, self.keys.injections, self.injections.on_requests)
        # In slices: Python runs a signal's handler in the main thread, but the kernel may deliver
        # the signal to any thread (gRPC's, the monitor's); an untimed wait would then sleep
        # through a SIGTERM until the job ends, and the preemption notice would never be acted on.
        while not self.done.wait(_SIGNAL_SLICE_S):
            pass
        requests.cancel()
        trigger.close()
        self._shutdown()
        assert self.exit_code is not None
        return self.exit_code

    def _spawn_workers(self) -> None:
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = str(self.threads)
        env[TOKEN_ENV] = self.token
        env[AGENT_PID_ENV] = str(os.getpid())  # the worker dies with this agent (die_with_parent)
        env[SPAWNED_AT_ENV] = repr(time.time())
        env.pop(FORKED_AT_ENV, None)  # this agent's own: a worker started cold must not read it as its fork
        name = f"elastic-relay-{self.keys.job}-{self.node}.{self.incarnation}-{os.getpid()}"
        self.relay = NodeRelay(self.client, name=name, workers=self.gpus)
        env[RELAY_ENV] = name
        env.pop(STORE_RELAY_ENV, None)
        if os.environ.get(STORE_RELAY_SWITCH) == "1":  # the rendezvous's sets and reads, a node's together
            self.store_relay = StoreRelay(self.client, name=f"{name}.store")
            env[STORE_RELAY_ENV] = self.store_relay.name
        lease = self.membership.lease_id
        assert lease is not None
        for local_rank in range(self.gpus):
            path = worker_log_path(self.run_dir, self.node, local_rank, self.incarnation)
            path.parent.mkdir(parents=True, exist_ok=True)
            args = ["--etcd", self.endpoint, "--job", self.keys.job, "--node", str(self.node),
                    "--local-rank", str(local_rank), "--incarnation", str(self.incarnation), "--lease", str(lease)]
            with open(path, "wb") as out:
                proc = start_process("elastic.roles.elastic_worker", args, zygote=self.zygote, env=env, stdout=out,
                                     stderr=subprocess.STDOUT, warn=lambda what: log.warning("%s: %s", self.who, what))
            if self.cpu_group:  # forked by the warm parent, not by this agent: put in the node's cgroup here
                cpu_quota.join(self.cpu_group, proc.pid)
            self.procs[proc.pid] = proc
        log.warning("%s (incarnation %d): workers %s (%s)", self.who, self.incarnation, sorted(self.procs),
                    "warm" if self.zygote is not None else "cold")
        threading.Thread(target=self._record_start, name="start-phases", daemon=True).start()

    def _record_start(self) -> None:
        """Once every worker registered: one `started` event with the phases of this node's start
        (the slowest worker's), from the agent's own start to the last registration."""
        deadline = time.monotonic() + _START_RECORD_S
        infos: list[WorkerInfo] = []
        while not self.done.is_set() and time.monotonic() < deadline:
            try:
                infos = list(read_registrations(self.client, self.rk, node=self.node).values())
            except Exception as exc:  # a transient etcd error: try again
                log.debug("reading the worker registrations: %s", exc)
            infos = [i for i in infos if i.incarnation == self.incarnation and i.pid in self.procs]
            if len(infos) == len(self.procs):
                break
            time.sleep(0.05)
        else:
            return
        phases = start_phases(self.started_at, [i.started for i in infos])
        try:
            record_event(self.client, self.keys, who=self.who, kind="started", incarnation=self.incarnation,
                         warm=all(i.started.get("forked") is not None for i in infos), **phases)
        except Exception as exc:
            log.warning("%s: could not record its start: %s", self.who, exc)

    def _on_death(self, pid: int) -> None:
        code = self.procs[pid].wait()
        done, _ = self.client.get(self.rk.worker_done(self.node, _local_rank(self.procs, pid)))
        if done is not None:  # finished its job (a crash in interpreter teardown does not matter)
            with self.lock:
                self._finished.add(pid)
                if len(self._finished) == len(self.procs):
                    self.finish(0)
            return
        self.fail(f"worker pid {pid} exited with code {code}")

    def _watch_stopped(self) -> None:
        while not self.done.wait(_STOPPED_CHECK_S):
            if self.injections.hanging or self.injections.partitioned:  # injected: the lease must expire, not be revoked
                return
            stopped = None
            with self.injections.signal_lock:  # a Throttle changes `active` and signals only under this lock
                if self.injections.throttled():
                    continue
                # /proc directly: a psutil.Process costs 4x as much, 10 times a second a worker
                stopped = next((pid for pid in list(self.procs) if process_state(pid) in ("T", "t")), None)
            if stopped is not None:
                self.fail(f"worker pid {stopped} is stopped (hung)")
                return

    def _probe_answer(self) -> dict[str, object] | None:
        """The probe's answer: this incarnation, and whether all its workers run (None while an
        emulated partition cuts the node off: a partitioned node is not reached)."""
        if self.injections.partitioned:
            return None
        procs = list(self.procs.values())
        alive = self.exit_code is None and bool(procs) and all(p.poll() is None for p in procs)
        return {"node_id": self.who, "incarnation": self.incarnation, "alive": alive}

    def _recampaign(self) -> None:
        """The election's lease expired while this agent lives: campaign again (on a thread of its
        own; this runs on the lease's)."""
        if self.exit_code is None and not (self.injections.hanging or self.injections.partitioned):
            threading.Thread(target=campaign_again, args=(self,), name="recampaign", daemon=True).start()

    def _on_lease_lost(self) -> None:
        """Our lease expired while we could not refresh it: keep our place if the node lives
        (elastic/roles/agent_rejoin.py); else (the job has fenced this node out), or when etcd stayed unreachable
        past the give-up time, stop the workers and leave."""
        reason = self.membership.lost_reason or "lease expired"
        if reason == "lease expired" and self.leader is not None:
            self.leader.guard.note_stall()  # what the leader (if this agent leads next) records
        try:
            if reason == "lease expired" and keep_place(self):
                return
        except Exception:  # the fencing below must run whatever went wrong
            log.exception("%s: keeping its place failed", self.who)
        log.warning("%s (incarnation %d): %s, the node is fenced; leaving", self.who, self.incarnation, reason)
        if reason.startswith("etcd unreachable"):
            stop_retrying(self.client)  # the tidying-up calls below would each wait out the retries
        with self.lock:
            if self.exit_code is not None:
                return
            try:
                record_event(self.client, self.keys, who=self.who, kind="fenced", incarnation=self.incarnation,
                             reason=reason)
            except Exception as exc:  # etcd may be the reason; the workers must stop regardless
                log.warning("%s: could not record the fencing: %s", self.who, exc)
            finally:
                self.kill_workers()
                self.finish(EXIT_FAILED if reason.startswith("etcd unreachable") else EXIT_FENCED)

    def fail(self, reason: str) -> None:
        """Report the node failed (its lease revoked), kill its workers and finish (EXIT_FAILED)."""
        with self.lock:
            if self.exit_code is not None:
                return
            log.warning("%s failed: %s", self.who, reason)
            try:
                self.membership.report_failure(reason=reason)
            finally:
                self.kill_workers()
                self.finish_failed()

    def finish(self, code: int) -> None:
        """End the agent's run with exit `code` (the first call decides)."""
        if self.exit_code is None:
            self.exit_code = code
            self.done.set()

    def finish_failed(self) -> None:
        """End the agent's run as a failed node (EXIT_FAILED)."""
        self.finish(EXIT_FAILED)

    def kill_workers(self) -> None:
        """SIGKILL every worker of the node still running."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()

    def _start_metrics(self) -> None:
        """The node's Prometheus endpoint (elastic/ops/metrics.py); its address goes under
        `metrics/<node>` on the node's lease. A port clash costs the metrics, not the node."""
        from elastic.ops.metrics import NodeMetrics

        try:
            self.metrics = NodeMetrics(self.client, self.keys, node=self.node,
                                       lease=self.membership.lease_id).start()
        except OSError as exc:
            log.warning("%s: no metrics endpoint: %s", self.who, exc)

    def _shutdown(self) -> None:
        self.probe.stop()
        if self.metrics is not None:
            self.metrics.stop()
        if self.monitor is not None:
            self.monitor.stop()
        if self.leader is not None:
            self.leader.stop()
        self.kill_workers()
        for proc in self.procs.values():
            proc.wait()
        if self.relay is not None:
            self.relay.close()
        if self.store_relay is not None:
            self.store_relay.close()
            log.warning("%s: the store relay made %d etcd requests", self.who, self.store_relay.requests)
        if self.zygote is not None:
            self.zygote.close()
        self.injections.join(timeout=2.0)  # a partition cut short writes its status on the way out
        for step in (self.election.resign, self.membership.leave):
            try:  # a partitioned or fenced node's leases are already gone
                step()
            except Exception as exc:
                log.warning("%s: %s on the way out: %s", self.who, step.__name__, exc)
        self.client.close()


def _local_rank(procs: dict[int, subprocess.Popen[bytes] | WarmProcess], pid: int) -> int:
    return list(procs).index(pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elastic.roles.agent", description=__doc__)
    env = os.environ
    parser.add_argument(
        "--etcd",
        default=env.get("ELASTIC_ETCD_ENDPOINT"),
        help="etcd endpoint host:port, or the members host:port,... (default $ELASTIC_ETCD_ENDPOINT)",
    )
    parser.add_argument("--job", default=env.get("ELASTIC_JOB"), help="job id (default $ELASTIC_JOB)")
    parser.add_argument(
        "--node",
        type=int,
        default=None,
        help="plan node of this agent (default: N of $ELASTIC_NODE_ID=nodeN)",
    )
    parser.add_argument("--incarnation", type=int, default=int(env.get("ELASTIC_INCARNATION", "0")),
                        help="how many times this node restarted (default $ELASTIC_INCARNATION or 0)")
    args = parser.parse_args(argv)
    if args.node is None and env.get("ELASTIC_NODE_ID"):
        try:
            args.node = node_of(env["ELASTIC_NODE_ID"])
        except ValueError:
            parser.error(
                f"ELASTIC_NODE_ID={env['ELASTIC_NODE_ID']!r}: the rendezvous node_id must be node<N>"
            )
    for flag, value in (("--etcd", args.etcd), ("--job", args.job), ("--node", args.node)):
        if value is None:
            parser.error(f"{flag} is required (or run under torchrun's elastic-etcd rendezvous)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack to the log
    try:
        agent = Agent(endpoint=args.etcd, job=args.job, node=args.node, incarnation=args.incarnation,
                      token=os.environ.get(TOKEN_ENV, ""))
    except JobAccessError as exc:  # refused before writing anything under the job
        print(f"elastic agent: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    try:
        grace = float(os.environ.get(PREEMPT_GRACE_ENV, PREEMPT_GRACE_S))
    except ValueError:
        print(f"elastic agent: error: ${PREEMPT_GRACE_ENV} must be seconds, got {os.environ[PREEMPT_GRACE_ENV]!r}",
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda signum, frame: agent.preemption.preempt(grace))
    signal.signal(signal.SIGINT, lambda signum, frame: agent.finish_failed())
    launcher = watch_launcher(agent, os.environ.get(LAUNCHER_PID_ENV))
    code = agent.run()
    if launcher is not None:
        launcher.stop()
    log.warning("%s (incarnation %d): exiting with code %d", agent.who, agent.incarnation, code)
    return code


if __name__ == "__main__":
    sys.exit(main())
