"""A real two-node SLURM cluster on this machine, for tests: munged, slurmctld and one slurmd per
node, Debian's SLURM 22.05 as packaged (scripts/install_test_system.sh installs it as root when
missing).

    root namespace: munged (its socket in the cluster's directory), slurmctld on the bridge address
    namespace <prefix>n<k> (deploy/netns/topology.py) + its own UTS namespace, hostname <prefix>n<k>:
        slurmd -N <prefix>n<k>, at 10.213.S.(10+k); its job steps and their tasks run there too

Each slurmd runs in its node's network namespace (entered with `nsenter --net`, not `ip netns
exec`: that one remounts /sys, and slurmd 22.05 wants the host's cgroup mounts at /sys/fs/cgroup
even with `proctrack/linuxproc` and `task/none`) and in a UTS namespace of its own, so that
`hostname` and `hostname -I` inside a job give that node's name and address, as on two hosts.
Every node declares one `gpu` GRES backed by /dev/null, so the batch script's
`--gpus-per-node=1` is honoured as written (the workers still compute on CPU). There is no
slurmdbd: `AccountingStorageType=accounting_storage/none` with `JobCompType=jobcomp/filetxt`,
so a job's end state is in the job-completion file, which `sacct --completion` reads.
Every daemon is started here and stopped by PID (`SlurmCluster.stop`); what runs inside the
namespaces (slurmstepd, job steps) goes with them (`Topology.destroy` kills them by PID).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil

from elastic.coordinator.etcd_server import free_port
from tests.polling import wait_for

REPO = Path(__file__).resolve().parents[2]
TOPOLOGY = REPO / "deploy" / "netns" / "topology.py"
SBIN_PATH = "/usr/sbin:/sbin:/usr/bin:/bin"
"""Where Debian puts the daemons (searched after $PATH)."""
CLIENT_TIMEOUT_S = 30.0
"""Deadline of one SLURM client command (sbatch, squeue, sacct, scontrol)."""


def _topology_module() -> ModuleType:
    """deploy/netns/topology.py (not a package: loaded from its file, once)."""
    name = "elastic_deploy_netns_topology"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TOPOLOGY)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return sys.modules[name]


def binary(name: str) -> str:
    """The path of SLURM's or munge's program `name`; AssertionError (the test fails, it does not
    skip) when the packages are missing: scripts/install_test_system.sh installs them as root."""
    path = shutil.which(name, path=f"{os.environ.get('PATH', '')}:{SBIN_PATH}")
    assert path is not None, (f"{name} is not installed: run scripts/install_test_system.sh as root "
                              "(apt-get install slurmctld slurmd slurm-client munge)")
    return path


def stop_pid(pid: int, *, grace_s: float = 10.0) -> None:
    """SIGTERM `pid` and every process under it (found by PID first), SIGKILL what is left
    after `grace_s`, and wait until they are gone."""
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=5.0)


@dataclass
class SlurmCluster:
    """The daemons of one cluster; `start_cluster` builds it, `stop` removes every part."""

    root: Path
    """Directory of slurm.conf, gres.conf, munge's key and socket, state, spool and logs."""
    topology: Any
    """deploy/netns Topology: one namespace per SLURM node."""
    daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    """munged, slurmctld and slurmd:<node>, by name."""

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def nodes(self) -> list[str]:
        """SLURM node names (= each namespace's hostname), in order."""
        return [m.namespace for m in self.topology.members]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """This process's environment for a SLURM client (or a job it submits): SLURM_CONF set,
        no SLURM_* of an enclosing job, no warm parent of the test session (a job's processes
        must be started inside the nodes' namespaces, not forked from a parent outside)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "ELASTIC_ZYGOTE"}
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = f"{env.get('PATH', '')}:{SBIN_PATH}"
        return {**env, **(extra or {})}

    def client(self, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
        """Run SLURM client command ARGS (bounded); its stdout. AssertionError with stderr on failure."""
        proc = subprocess.run(list(args), capture_output=True, text=True, cwd=cwd, env=env or self.env(),
                              timeout=CLIENT_TIMEOUT_S, check=False)
        assert proc.returncode == 0, f"{' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()}"
        return proc.stdout

    def node_states(self) -> dict[str, str]:
        """`sinfo -N`: node name -> its compact state (idle, alloc, drng, drain, ...)."""
        out = self.client("sinfo", "-h", "-N", "-o", "%N %t")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def job_state(self, job: int) -> str:
        """The job's state as `squeue --states=all` shows it (slurmctld keeps an ended job for
        MinJobAge, 300 s by default): PENDING, RUNNING, COMPLETED, FAILED, ..."""
        return self.client("squeue", "-h", "--states=all", "-j", str(job), "-o", "%T").strip()

    def sacct_state(self, job: int) -> str:
        """The job's state as `sacct --completion` reads it from the job-completion file."""
        out = self.client("sacct", "--completion", "-n", "-P", "-j", str(job), "-o", "JobID,State")
        states = dict(line.split("|", 1) for line in out.splitlines() if line.strip())
        return states.get(str(job), "")

    def jobcomp_record(self, job: int) -> dict[str, str]:
        """The job's record in the job-completion file (jobcomp/filetxt): its KEY=VALUE fields."""
        path = self.root / "jobcomp.txt"
        for line in path.read_text().splitlines() if path.exists() else []:
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            if fields.get("JobId") == str(job):
                return fields
        return {}

    def wait_ended(self, job: int, timeout: float) -> str:
        """Block until the job has left PENDING/RUNNING/COMPLETING; its final squeue state."""
        return str(wait_for(lambda: (s := self.job_state(job)) not in ("", "PENDING", "RUNNING",
                                                                        "CONFIGURING", "COMPLETING") and s,
                            timeout, f"SLURM job {job} to end"))

    def step_pids(self, step: str, node: str) -> list[int]:
        """PIDs of job step `step` (JOB.STEP) on `node`, as `scontrol listpids` has them from that
        node's slurmstepd (proctrack/linuxproc: the step's tasks and every descendant)."""
        out = self.client("scontrol", "listpids", step, node)
        return [int(line.split()[0]) for line in out.splitlines()[1:] if line.strip()]

    def wait_idle(self, timeout: float) -> None:
        """Block until every node is idle (registered, no job completing on it, not drained)."""
        wait_for(lambda: _all_idle(self), timeout, "every SLURM node to be idle")

    def stop(self) -> None:
        """Cancel every job, stop the slurmds, kill what is left in the namespaces and delete
        them, then stop slurmctld and munged: all by PID."""
        with contextlib.suppress(Exception):
            if "slurmctld" in self.daemons:
                subprocess.run(["scancel", "--full", "--user=root"], env=self.env(), capture_output=True,
                               timeout=CLIENT_TIMEOUT_S, check=False)
        for name in [n for n in self.daemons if n.startswith("slurmd:")]:
            self._stop_daemon(name)
        self.topology.destroy()  # slurmstepd and job processes, by PID, then the namespaces and links
        self._stop_daemon("slurmctld")
        self._stop_daemon("munged")

    def _stop_daemon(self, name: str) -> None:
        """Stop daemon `name` and its children by PID (if it was started), and reap it."""
        proc = self.daemons.pop(name, None)
        if proc is not None:
            stop_pid(proc.pid)
            proc.wait(timeout=5.0)


def _write_conf(root: Path, topology: Any) -> None:
    """slurm.conf and gres.conf for the cluster: controller on the bridge address, one node per
    namespace with 8 CPUs (config_overrides: the batch script's --cpus-per-task=8 fits on this
    2-core machine) and one gpu GRES backed by /dev/null."""
    host = socket.gethostname().split(".")[0]
    names = [m.namespace for m in topology.members]
    lines = [
        "ClusterName=elastictest",
        f"SlurmctldHost={host}({topology.bridge_address})",
        # below the kernel's ephemeral range: slurmctld binds it seconds later, and a port of that range
        # was once taken meanwhile by an outgoing connection of the tests beside it ("Address already in use")
        f"SlurmctldPort={free_port(topology.bridge_address)}",
        "SlurmdPort=6818",  # one slurmd per network namespace: no clash
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={root}/munge/munge.socket",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "SchedulerParameters=sched_interval=2",  # a job submitted while nodes complete waits 2 s, not 60
        "GresTypes=gpu", "ReturnToService=2", "SlurmdParameters=config_overrides", "MailProg=/bin/true",
        "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/filetxt", f"JobCompLoc={root}/jobcomp.txt",
        *(f"NodeName={m.namespace} NodeHostname={m.namespace} NodeAddr={m.address} CPUs=8 Gres=gpu:1 State=UNKNOWN"
          for m in topology.members),
        f"PartitionName=debug Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP",
    ]
    (root / "slurm.conf").write_text("\n".join(lines) + "\n")
    (root / "gres.conf").write_text("".join(f"NodeName={n} Name=gpu File=/dev/null\n" for n in names))


def _daemon(cluster: SlurmCluster, name: str, argv: list[str]) -> None:
    """Start daemon `name` (foreground mode, output to <root>/<name>.out) and record it."""
    out = (cluster.root / f"{name.replace(':', '-')}.out").open("wb")
    cluster.daemons[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=cluster.env())
    out.close()


def _start_munge(cluster: SlurmCluster) -> None:
    """munged with a fresh key, its socket in the cluster's directory; waits for the socket."""
    munge = cluster.root / "munge"
    munge.mkdir(mode=0o700)
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    _daemon(cluster, "munged", [binary("munged"), "-F", "--force", f"--socket={munge}/munge.socket",
                                f"--key-file={key}", f"--log-file={munge}/munged.log",
                                f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/munged.seed"])
    wait_for(lambda: (munge / "munge.socket").exists(), 20.0, "munged's socket")


def _start_slurmd(cluster: SlurmCluster, namespace: str) -> None:
    """slurmd for node `namespace`, inside that network namespace and a UTS namespace whose
    hostname is the node's name (nsenter and unshare exec: the PID recorded is slurmd's)."""
    (cluster.root / "spool" / namespace).mkdir(parents=True)
    _daemon(cluster, f"slurmd:{namespace}", [
        "nsenter", f"--net=/run/netns/{namespace}", "unshare", "--uts", "sh", "-c",
        'hostname "$0" && exec "$1" -D -N "$0" -f "$2"', namespace, binary("slurmd"), str(cluster.conf)])


def start_cluster(root: Path, *, nodes: int = 2) -> SlurmCluster:
    """Build the namespaces, start munged, slurmctld and one slurmd per node, and wait until every
    node is idle. On any failure, whatever was started is stopped and the error raised."""
    topology = _topology_module().Topology(nodes=nodes, prefix=f"sl{os.getpid() % 100000}")
    cluster = SlurmCluster(root=root, topology=topology)
    try:
        topology.create()
        (root / "state").mkdir()
        _write_conf(root, topology)
        _start_munge(cluster)
        _daemon(cluster, "slurmctld", [binary("slurmctld"), "-D", "-f", str(cluster.conf)])
        for name in cluster.nodes:
            _start_slurmd(cluster, name)
        cluster.wait_idle(60.0)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _all_idle(cluster: SlurmCluster) -> bool:
    """Whether every node is idle; AssertionError if a daemon has exited."""
    dead = {n: p.returncode for n, p in cluster.daemons.items() if p.poll() is not None}
    assert not dead, f"SLURM daemons exited: {dead} (logs in {cluster.root})"
    with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
        states = cluster.node_states()
        return sorted(states) == sorted(cluster.nodes) and set(states.values()) == {"idle"}
    return False


def wait_file_line(path: Path, pattern: str, timeout: float) -> re.Match[str]:
    """The first match of regex `pattern` in the text file `path` (which may not exist yet)."""
    def found() -> re.Match[str] | None:
        return re.search(pattern, path.read_text()) if path.exists() else None
    match: re.Match[str] = wait_for(found, timeout, f"{pattern!r} in {path}")
    return match
