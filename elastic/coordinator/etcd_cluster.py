"""N private etcd members on one host forming one cluster: `elastic run --etcd-members N`, and
tests that kill, pause and restart members under a live job; its `endpoint` is the member list.
Each member is an `EtcdServer` (etcd_server.py) with its guarantees."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from elastic.coordinator.etcd_server import AUTO_COMPACTION, PORT_TRIES, EtcdServer

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
        self._name_peers()
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
        """Start every member that is not running and wait until each is healthy. A first start
        that finds a port taken since it was picked starts the whole cluster again on new ports
        (`PORT_TRIES` in all); a restart keeps them."""
        first = not any(m.served for m in self.members)
        for attempt in range(1, PORT_TRIES + 1):
            stopped = [m for m in self.members if not m.running()]
            offsets = [m.log_size() for m in stopped]
            for member in stopped:
                member.start(wait=False)
            try:
                for member in stopped:
                    member.wait_healthy()
            except RuntimeError:
                lost = any(m.lost_port_since(o) for m, o in zip(stopped, offsets, strict=True))
                if not first or attempt == PORT_TRIES or not lost:
                    raise
                self._start_over()
                continue
            return self
        return self

    def _start_over(self) -> None:
        """Stop a cluster whose first start failed, forget what its members wrote and give them
        new ports (a member's data dir names its peers)."""
        for member in self.members:
            member.stop(kill=True)
            shutil.rmtree(member.data_dir / "data", ignore_errors=True)
            member.repick_ports()
        self._name_peers()

    def _name_peers(self) -> None:
        """Give every member the `--initial-cluster` naming all members at their peer URLs."""
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for member in self.members:
            member.initial_cluster = initial

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
