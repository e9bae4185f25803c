"""`elastic run --node-cpus`: each node's processes in a cgroup capped at X cores (elastic/roles/cpu_quota.py).

On real cgroups (skipped where none is writable): a capped spinner gets its quota against an
uncapped one beside it, and with the throttle's burner beside it the two share that quota; a
job's workers (not its agents) are in their node's group while it runs, and every group is gone
when it ends; a SIGKILLed launcher's empty groups are swept by the next.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from elastic.records.throttle import Throttle
from elastic.roles.cpu_quota import STALE_S, CpuQuotaError, NodeCpuQuotas, find_hierarchy, join
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


@needs_cgroups
def test_a_burner_spins_in_the_throttled_process_quota() -> None:
    quotas = NodeCpuQuotas(cpus=0.3, job=f"test-{secrets.token_hex(4)}")
    spinner = subprocess.Popen([sys.executable, "-c", _SPIN])
    throttle = Throttle([spinner.pid], factor=3.0, seconds=30.0, lock=threading.Lock(), hold_cpu=True,
                        cgroup=str(quotas.group(0)))
    stop = threading.Event()
    thread = threading.Thread(target=throttle.run, args=(stop,), daemon=True)
    try:
        join(quotas.group(0), spinner.pid)
        thread.start()
        deadline = time.monotonic() + 10
        while not throttle.burners and time.monotonic() < deadline:
            time.sleep(0.01)
        assert throttle.burners, "the throttle started no burner"
        burner = throttle.burners[0]
        assert str(burner.pid) in (quotas.group(0) / "cgroup.procs").read_text().split()
        both = _cpu_seconds([spinner, burner], 1.5)  # type: ignore[list-item]
        assert sum(both) < 0.3 * 1.5 * 1.25, both  # the two together: the node's quota, no more
        assert both[1] > 0.3 * both[0], both  # the burner took its part of it (factor 3: about 2/3)
    finally:
        stop.set()
        thread.join(10)
        stop_pids([spinner.pid])
        spinner.wait()
        quotas.close()


@needs_cgroups
def test_a_killed_launchers_groups_are_swept_and_a_live_ones_kept() -> None:
    old = time.time() - 2 * STALE_S
    stale, busy, young = (HIERARCHY.root / f"elastic-test-{what}-{secrets.token_hex(3)}" for what in ("stale", "busy", "young"))
    spinner = subprocess.Popen([sys.executable, "-c", _SPIN])
    quotas = None
    try:
        for group in (stale, busy, young):
            (group / "node0").mkdir(parents=True)
            if group is not young:
                os.utime(group, (old, old))
        join(busy / "node0", spinner.pid)
        quotas = NodeCpuQuotas(cpus=0.5, job=f"test-{secrets.token_hex(4)}")  # sweeps on the way in
        assert not stale.exists()
        assert busy.exists() and young.exists()  # a process in it; too recent to be a leftover
    finally:
        stop_pids([spinner.pid])
        spinner.wait()
        for group in (stale, busy, young):
            for path in (group / "node0", group):
                with contextlib.suppress(OSError):
                    path.rmdir()
        if quotas is not None:
            quotas.close()


def test_bad_caps_and_hierarchies_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CpuQuotaError, match="no cgroup cpu controller"):
        find_hierarchy(tmp_path)
    with pytest.raises(CpuQuotaError, match="at least 0.01"):
        NodeCpuQuotas(cpus=0.005, job="x", root=tmp_path)
    bad = subprocess.run([sys.executable, "-m", "elastic.cli", "run", "--nodes", "2", "--node-cpus", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--node-cpus" in bad.stderr, bad.stderr


def _members(group: Path) -> list[str]:
    """The last part of the module each process in `group` runs (agent, elastic_worker)."""
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
        if all(s == ["elastic_worker"] for s in seen):
            break
        time.sleep(0.2)
    quotas = [(g / "cpu.max").read_text().split() if HIERARCHY.v2 else
              [(g / f"cpu.cfs_{f}_us").read_text().strip() for f in ("quota", "period")] for g in groups]
    thread.join(200.0)
    assert "error" not in outcome, outcome.get("error")
    assert seen == [["elastic_worker"]] * 2, seen  # the agent stays out: it is the host's, not the device's
    assert quotas == [["1000", "1250"]] * 2  # 0.8 core: 1 ms every 1.25 ms
    assert outcome["summary"].steps_committed == 40
    assert not (HIERARCHY.root / f"elastic-{job}").exists()  # removed on the way out
