"""CPU a running job's processes use, by role, over a window of its steps.

`TreeCpu.sample()` reads the CPU seconds (user + system) of a process and of every descendant,
each under a role from its command line (etcd, launcher, agent, worker, zygote, other);
`cores_between` turns two samples into cores by role over the wall time between them. A process
that started between the samples counts from zero; one that ended is left out (its CPU is no
longer readable), which for a window inside a failure-free run's steps loses nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import psutil

ROLES = (
    ("agent", "elastic.roles.agent"),
    ("zygote", "elastic.roles.zygote"),
    ("worker", "elastic.roles.elastic_worker"),
    ("worker", "elastic.roles.static_worker"),
    ("worker", "elastic worker"),
    ("launcher", "elastic.cli"),
)
"""(role, a command-line substring that marks it), first match wins; etcd is known by its
executable's name (every other process names `--etcd` among its flags)."""


def role_of(cmdline: list[str]) -> str:
    """The role of a process with this command line (ROLES), else "other"."""
    if cmdline and os.path.basename(cmdline[0]) == "etcd":
        return "etcd"
    joined = " ".join(cmdline)
    for role, mark in ROLES:
        if mark in joined:
            return role
    return "other"


@dataclass(frozen=True, kw_only=True)
class Sample:
    """CPU seconds of a process tree at one moment."""

    at: float
    """monotonic() of the sample."""
    cpu: dict[int, tuple[str, float]]
    """pid -> (role, CPU seconds so far)."""


class TreeCpu:
    """Samples of the process tree under `pid` (module doc)."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)

    def sample(self) -> Sample:
        cpu: dict[int, tuple[str, float]] = {}
        procs = [self.root]
        with contextlib.suppress(psutil.Error):
            procs += self.root.children(recursive=True)
        for proc in procs:
            try:
                times = proc.cpu_times()
                cpu[proc.pid] = (role_of(proc.cmdline()), times.user + times.system)
            except psutil.Error:  # ended meanwhile
                continue
        return Sample(at=time.monotonic(), cpu=cpu)


def cores_between(before: Sample, after: Sample) -> dict[str, float]:
    """Cores each role used between two samples (processes of both, or started in between)."""
    seconds = after.at - before.at
    out: dict[str, float] = {}
    for pid, (role, cpu) in after.cpu.items():
        start = before.cpu.get(pid, (role, 0.0))[1]
        out[role] = out.get(role, 0.0) + (cpu - start) / seconds
    return dict(sorted(out.items()))
