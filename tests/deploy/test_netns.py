"""deploy/netns/launch.py on real namespaces: a real partition (a downed veth) is survived.

Skipped unless this process is root and `ip netns add` works (CI usually is not root). One
live run (3 nodes x 1 worker, tiny, f=1, node 2 cut off during step 3) serves every assertion
about recovery; a second, short launch is interrupted with SIGTERM to check the teardown.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.polling import wait_for

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "deploy" / "netns" / "launch.py"
STEPS = 8
PARTITION = {"node": 2, "step": 3, "seconds": 6}


def _netns_works() -> bool:
    if os.geteuid() != 0:
        return False
    name = f"eltest{os.getpid() % 100000}"
    try:
        made = subprocess.run(["ip", "netns", "add", name], capture_output=True, check=False)
    except FileNotFoundError:
        return False
    subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    return made.returncode == 0


needs_netns = pytest.mark.skipif(not _netns_works(), reason="needs root and a working `ip netns`")


def _leftovers(prefix: str) -> list[str]:
    """Namespaces and links of launch `prefix` that still exist."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    found = [line.split()[0] for line in netns.splitlines() if line.startswith(f"{prefix}n")]
    found += [f.split()[1] for f in links.splitlines() if f.split()[1].startswith(prefix)]
    return found


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def partitioned_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("netns-run")
    summary = run_dir / "summary.json"
    part = ",".join(f"{k}={v}" for k, v in PARTITION.items())
    cmd = [sys.executable, str(LAUNCH), "--nodes", "3", "--fault-tolerance", "1", "--steps", str(STEPS),
           "--run-dir", str(run_dir), "--summary", str(summary), "--partition", part, "--timeout", "150"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=170)
    finally:
        _stop(proc)
    netns = json.loads((run_dir / "netns.json").read_text())
    return {
        "code": proc.returncode,
        "out": out,
        "summary": json.loads(summary.read_text()) if summary.exists() else None,
        "partitions": json.loads((run_dir / "partitions.json").read_text()),
        "netns": netns,
        "run_dir": run_dir,
    }


@needs_netns
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_partitioned_node_is_lost_and_the_job_commits_every_step(partitioned_run: dict[str, Any]) -> None:
    assert partitioned_run["code"] == 0, partitioned_run["out"][-3000:]
    summary = partitioned_run["summary"]
    assert summary["steps_committed"] == STEPS
    assert len(summary["losses"]) == STEPS
    assert [r["lost_nodes"] for r in summary["recoveries"]] == [[PARTITION["node"]]]
    assert summary["recoveries"][0]["generation"] == 2
    # Steps before the cut ran in generation 1, the rest (from the replayed step on) in generation 2.
    gens = summary["step_generations"]
    assert gens[: PARTITION["step"] - 1] == [1] * (PARTITION["step"] - 1)
    assert gens[-1] == 2 and gens == sorted(gens)
    # The loss was detected while the link was down: the partition, not something else, caused it.
    (cut,) = partitioned_run["partitions"]
    assert cut["node"] == PARTITION["node"]
    assert cut["down_at"] < summary["recoveries"][0]["detected_at"] < cut["up_at"]
    assert summary["worker_restarts"] == 0


@needs_netns
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_addresses_are_the_namespaces_and_everything_is_removed(partitioned_run: dict[str, Any]) -> None:
    netns = partitioned_run["netns"]
    assert netns["etcd"].startswith("10.213.")
    assert sorted(n["address"] for n in netns["nodes"].values()) == [
        netns["etcd"].split(":")[0].rsplit(".", 1)[0] + f".{10 + k}" for k in range(3)
    ]
    assert _leftovers(netns["prefix"]) == []
    procs = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert f"netns-{netns['prefix']}" not in procs  # no agent or worker of the job is left


@pytest.mark.slow
@needs_netns
@pytest.mark.timeout(90)
def test_sigterm_tears_everything_down(tmp_path: Path) -> None:
    cmd = [sys.executable, str(LAUNCH), "--nodes", "2", "--steps", "50", "--run-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: (tmp_path / "netns.json").exists(), 60.0, "the namespaces to be created")
        prefix = json.loads((tmp_path / "netns.json").read_text())["prefix"]
        assert _leftovers(prefix)  # built
        time.sleep(1.0)  # agents are starting inside the namespaces
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        _stop(proc)
    assert proc.returncode == 130, out
    assert _leftovers(prefix) == []
    procs = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert f"netns-{prefix}" not in procs


@pytest.mark.timeout(60)
def test_not_root_exits_2_with_one_line() -> None:
    code = "import os; os.geteuid = lambda: 1000; import runpy, sys; sys.argv = ['launch.py']; " \
           f"runpy.run_path({str(LAUNCH)!r}, run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           cwd=LAUNCH.parent)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "needs root" in proc.stderr
