"""A simulated node's share of this host's CPU, as a cgroup CPU quota (`elastic run --node-cpus X`).

Simulated nodes on one host share its cores: a node that waits lends its core to the others, and
a node slowed by `elastic inject slow` is made up for by the others running faster. Real nodes
have devices of their own. With `--node-cpus X` the launcher makes one cgroup per node,
`<root>/elastic-<job>/node<N>`, capped at X cores (a CFS quota, `quota_of`: 1 ms every 2.5 ms for 0.4); the
node's agent puts each of its workers in it (they are forked by the warm parent, not by the
agent), and `elastic inject slow`'s burners join it, as they spin in the workers' place. The agent
itself stays out, as the control plane runs on a node's host CPU, not on its device; so do etcd,
the launcher and the warm parent: leave them some of the host's cores (on 2 cores, 4 nodes at
0.4 leave 0.4 core).

Both cgroup versions: v1 (a `cpu` hierarchy, `cpu.cfs_quota_us`) and v2 (`cpu.max`, the cpu
controller enabled in the root's `cgroup.subtree_control`). It needs write access to the
hierarchy (root, or a delegated subtree given as `root`).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

CPU_CGROUP_ENV = "ELASTIC_CPU_CGROUP"
"""The cgroup directory an agent joins, and puts its workers in (set by the launcher)."""

_MIN_QUOTA_US = 1_000
"""The kernel's least quota (and least period)."""
_MAX_PERIOD_US = 100_000


def quota_of(cpus: float) -> tuple[int, int]:
    """(quota, period) in microseconds for `cpus` cores: the shortest period whose quota the
    kernel takes (1 ms each at least). A node may run at full speed for its quota and then waits
    out the period, so a long period would let a short computation run faster than `cpus` cores
    allow and a long one slower: 2.5 ms at 0.4 core keeps every burst below a millisecond."""
    period = max(_MIN_QUOTA_US, round(_MIN_QUOTA_US / cpus))
    return round(cpus * period), period
_V1_ROOT = Path("/sys/fs/cgroup/cpu")
_V2_ROOT = Path("/sys/fs/cgroup")


class CpuQuotaError(RuntimeError):
    """No cgroup CPU quota can be set here: the message says what is missing."""


@dataclass(frozen=True, kw_only=True)
class CpuHierarchy:
    """Where CPU quotas are set on this host, and how."""

    root: Path
    """The directory under which the job's cgroups are made."""
    v2: bool
    """cgroup v2 (`cpu.max`) rather than v1 (`cpu.cfs_quota_us`)."""

    def set_quota(self, group: Path, cpus: float) -> None:
        """Cap `group` at `cpus` cores (`quota_of`)."""
        quota, period = quota_of(cpus)
        if self.v2:
            (group / "cpu.max").write_text(f"{quota} {period}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(quota))


def find_hierarchy(root: Path | None = None) -> CpuHierarchy:
    """This host's writable CPU hierarchy (under `root` if given); CpuQuotaError names what is missing."""
    for candidate in ([root] if root is not None else [_V1_ROOT, _V2_ROOT]):
        if (candidate / "cpu.cfs_quota_us").exists() or (candidate / "cpu.cfs_period_us").exists():
            hierarchy = CpuHierarchy(root=candidate, v2=False)
        elif "cpu" in _read(candidate / "cgroup.controllers").split():
            hierarchy = CpuHierarchy(root=candidate, v2=True)
        else:
            continue
        if not os.access(candidate, os.W_OK):
            raise CpuQuotaError(f"{candidate} is not writable (run as root, or give a delegated cgroup)")
        return hierarchy
    where = root if root is not None else f"{_V1_ROOT} or {_V2_ROOT}"
    raise CpuQuotaError(f"no cgroup cpu controller at {where}")


def join(group: str | Path, pid: int) -> None:
    """Move process `pid` (every thread of it) into cgroup `group`."""
    (Path(group) / "cgroup.procs").write_text(str(pid))


class NodeCpuQuotas:
    """One cgroup per node for one job, each capped at `cpus` cores; `close` removes them."""

    def __init__(self, *, cpus: float, job: str, root: Path | None = None) -> None:
        if not cpus * _MAX_PERIOD_US >= _MIN_QUOTA_US:
            raise CpuQuotaError(f"--node-cpus must be at least {_MIN_QUOTA_US / _MAX_PERIOD_US}, got {cpus}")
        self.cpus = cpus
        self.hierarchy = find_hierarchy(root)
        _sweep(self.hierarchy.root)
        self.job_group = self.hierarchy.root / f"elastic-{job}"
        try:
            self.job_group.mkdir(exist_ok=True)
            if self.hierarchy.v2:  # the nodes' quotas need the controller enabled below the job's group too
                for parent in (self.hierarchy.root, self.job_group):
                    if "cpu" not in _read(parent / "cgroup.subtree_control").split():
                        (parent / "cgroup.subtree_control").write_text("+cpu")
        except OSError as exc:
            self.close()
            raise CpuQuotaError(f"cannot make {self.job_group}: {exc}") from None
        self.groups: dict[int, Path] = {}

    def group(self, node: int) -> Path:
        """Node `node`'s cgroup (made, with its quota, on first use)."""
        if node not in self.groups or not self.groups[node].exists():
            path = self.job_group / f"node{node}"
            path.mkdir(parents=True, exist_ok=True)
            self.hierarchy.set_quota(path, self.cpus)
            self.groups[node] = path
        return self.groups[node]

    def close(self) -> None:
        """Remove the job's cgroups; a process still in one is moved to the root first."""
        for path in [*getattr(self, "groups", {}).values(), self.job_group]:
            for pid in _read(path / "cgroup.procs").split():
                with contextlib.suppress(OSError):  # it exited meanwhile
                    join(self.hierarchy.root, int(pid))
            with contextlib.suppress(OSError):  # gone already, or a process that would not move
                path.rmdir()
        self.groups = {}


STALE_S = 600.0
"""Age past which an empty job group is another launcher's leftover (one killed with SIGKILL)."""


def _sweep(root: Path) -> None:
    """Remove the job groups under `root` that hold no process and are older than STALE_S."""
    for job_group in root.glob("elastic-*"):
        try:
            if time.time() - job_group.stat().st_mtime < STALE_S:
                continue
            nodes = [p for p in job_group.iterdir() if p.is_dir()]
            if any(_read(p / "cgroup.procs").strip() for p in [*nodes, job_group]):
                continue
            for path in [*nodes, job_group]:
                path.rmdir()
        except OSError:  # gone meanwhile, or taken by a job that started meanwhile
            continue


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
