"""`elastic run --node-cpus`: each node's processes in a cgroup capped at X cores (elastic/roles/cpu_quota.py).

On real cgroups (skipped where none is writable): a capped spinner gets its quota against an
uncapped one beside it, a job's agents and workers are in their node's group while it runs, and
every group is gone when it ends.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from elastic.roles.cpu_quota import CpuQuotaError, NodeCpuQuotas, find_hierarchy, join
from tests.faults.runs import tiny_config
from tests.processes import stop_pids

pytestmark = pytest.mark.timeout(240)

try:
    HIERARCHY = find_hierarchy()
    WHY_NOT = ""
except CpuQuotaError as exc:
    WHY_NOT = str(exc)
needs_cgroups = pytest.mark.skipif(bool(WHY_NOT), reason=f"no writable cgroup cpu controller: {WHY_NOT}")

_SPIN = "import time\nwhile True: pass\n"


def _cpu_seconds(procs: list[subprocess.Popen[bytes]], seconds: float) -> list[float]:
    """CPU seconds each of `procs` used over the next `seconds` of wall time."""
    before = [psutil.Process(p.pid).cpu_times() for p in procs]
    time.sleep(seconds)
    after = [psutil.Process(p.pid).cpu_times() for p in procs]
    return [(a.user + a.system) - (b.user + b.system) for a, b in zip(after, before, strict=True)]


@needs_cgroups
def test_a_capped_spinner_gets_its_quota() -> None:
    quotas = NodeCpuQuotas(cpus=0.2, job=f"test-{secrets.token_hex(4)}")
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(2)]
    try:
        join(quotas.group(0), procs[0].pid)
        capped, free = _cpu_seconds(procs, 1.5)
        assert 0.2 * 1.5 * 0.6 < capped < 0.2 * 1.5 * 1.25, (capped, free)
        assert free > 2 * capped, (capped, free)  # the one beside it, in no group of ours, is not capped
    finally:
        quotas.close()  # procs[0] still runs: moved out first, so its group can go
        assert not quotas.job_group.exists()
        stop_pids([p.pid for p in procs])
        for p in procs:
            p.wait()


def test_bad_caps_and_hierarchies_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CpuQuotaError, match="no cgroup cpu controller"):
        find_hierarchy(tmp_path)
    with pytest.raises(CpuQuotaError, match="at least 0.1"):
        NodeCpuQuotas(cpus=0.05, job="x", root=tmp_path)
    bad = subprocess.run([sys.executable, "-m", "elastic.cli", "run", "--nodes", "2", "--node-cpus", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--node-cpus" in bad.stderr, bad.stderr


def _members(group: Path) -> list[str]:
    """The module each process in `group` runs (agent or worker)."""
    out = []
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            cmd = psutil.Process(int(pid)).cmdline()
        except psutil.NoSuchProcess:
            continue
        out += [arg.rsplit(".", 1)[-1] for arg in cmd if arg.startswith("elastic.roles.")]
    return sorted(out)


@needs_cgroups
def test_each_node_runs_in_its_group(tmp_path: Path) -> None:
    from elastic.roles.launcher import launch_elastic

    job = f"quota-{secrets.token_hex(4)}"
    config = tiny_config(tmp_path / "run", nodes=2, pipelines=2, steps=40, checkpoint_every=0)
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["summary"] = launch_elastic(config, job=job, quiet=True, timeout_s=180.0, node_cpus=0.8)
        except BaseException as exc:  # handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="elastic-run", daemon=True)
    thread.start()
    groups = [HIERARCHY.root / f"elastic-{job}" / f"node{n}" for n in range(2)]
    seen: list[list[str]] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and thread.is_alive():
        seen = [_members(g) if g.exists() else [] for g in groups]
        if all(s == ["agent", "elastic_worker"] for s in seen):
            break
        time.sleep(0.2)
    quotas = [(g / ("cpu.max" if HIERARCHY.v2 else "cpu.cfs_quota_us")).read_text().split()[0] for g in groups]
    thread.join(200.0)
    assert "error" not in outcome, outcome.get("error")
    assert seen == [["agent", "elastic_worker"]] * 2, seen
    assert quotas == ["8000", "8000"]  # 0.8 of each 10 ms period
    assert outcome["summary"].steps_committed == 40
    assert not (HIERARCHY.root / f"elastic-{job}").exists()  # removed on the way out
