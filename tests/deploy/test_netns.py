"""deploy/netns/launch.py on real namespaces: a real partition (a downed veth) is survived.

Skipped unless this process is root and `ip netns add` works (CI usually is not root). One
live run (3 nodes x 1 worker, tiny, f=1, node 2 cut off during step 3) serves every assertion
about recovery; a second, short launch is interrupted with SIGTERM to check the teardown.
Two more live runs hurt node 2's link in the other ways and are compared
with the failure-free result of the same job (one worker, `tests.faults.runs.reference_run`):
a sick link (50 ms delay, 1 % loss each way) causes no failure; a one-way partition (node 2's
packets to etcd dropped) fences node 2. Those two are `soak` (about a minute each).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.records.progress import StepResult
from tests.faults.runs import TOLERANCE, max_rel_diff, reference_run, step_logs
from tests.polling import wait_for

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "deploy" / "netns" / "launch.py"
STEPS = 8
PARTITION = {"node": 2, "step": 3, "seconds": 6}
LONG_STEPS = 600
"""Steps the one-way run may take: even at 0.05 s a step (an idle machine), training goes on well
past the node's loss after the one-way cut at step 4: its lease expires within the TTL (6 s), and a
node that answers the leader's probe but cannot reach etcd is lost two TTLs later
(elastic/roles/leader_suspects.py). The test stops it (`elastic drain --all`) once generation 2
has committed TRAINED_ON steps, and compares it with a failure-free run of as many steps."""
TRAINED_ON = 3
"""Steps generation 2 (the survivors, without the fenced node) commits before the one-way run is stopped."""
SICK_STEPS = 40
"""Steps of the sick-link run: the job all but stalls while the link is sick (about a step in 4 s
on this machine: gloo's connections wait out TCP retransmissions), so 40 steps end well after it."""
LONG_TTL = 6
"""Lease TTL of those runs: twice the default, so that CPU starvation on a loaded 2-core machine
(a failure-free run lost a node at TTL 3 s with the load at 30) does not pass for a network
fault. deploy/README.md has what the default TTL tolerates."""
SICK = {"node": 2, "step": 3, "seconds": 20, "delay": 50, "loss": 1}
"""Longer than the lease TTL (LONG_TTL): a lease kept over the sick link is what is shown; and
longer than two of the job's steps over it (4-9 s each, docs/operating.md), so that a step is
committed while it is sick (9 s once saw none, on a loaded machine)."""
ONE_WAY = {"node": 2, "step": 4, "seconds": 26, "mode": "oneway"}
"""Longer than three TTLs and the leader's rounds: the loss is detected while the cut lasts."""


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
           "--run-dir", str(run_dir), "--summary", str(summary), "--partition", part, "--timeout", "150",
           "--check"]  # gloo and gRPC probed between the namespaces before the job (deploy/netns/probe.py)
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


def _launch(run_dir: Path, steps: int, *flags: str, stop_after_gen2: int | None = None) -> dict[str, Any]:
    """Run launch.py (3 nodes, f=1) to the end, or (`stop_after_gen2`) until generation 2 has
    committed that many steps, then stop it as an operator would (`elastic drain --all`: at a step
    boundary, with a checkpoint, exit 3); its exit code, output, summary, final state,
    partitions.json, netns.json and step logs. Stragglers are reported, not acted on: the nodes
    share one machine, so a node's slow steps are the machine's noise (on a loaded CI machine, the
    one-way run once published two more generations that lost no node, as a rebalance does);
    tests/faults/test_stragglers.py has the rebalance."""
    summary, final, output = run_dir / "summary.json", run_dir / "final.pt", run_dir / "launch.out"
    cmd = [sys.executable, str(LAUNCH), "--nodes", "3", "--fault-tolerance", "1", "--steps", str(steps),
           "--run-dir", str(run_dir), "--summary", str(summary), "--final-state", str(final),
           "--timeout", "240", "--lease-ttl", str(LONG_TTL), "--straggler-policy", "report", *flags]
    with output.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, text=True)
        try:
            if stop_after_gen2 is not None:
                _stop_once_trained_on(proc, run_dir, stop_after_gen2)
            proc.wait(timeout=270)
        finally:
            _stop(proc)
    out = output.read_text()
    parts = run_dir / "partitions.json"
    return {
        "code": proc.returncode, "out": out,
        "summary": json.loads(summary.read_text()) if summary.exists() else None,
        "state": torch.load(final) if final.exists() else None,
        "partitions": json.loads(parts.read_text()) if parts.exists() else [],
        "netns": json.loads((run_dir / "netns.json").read_text()),
        "logs": step_logs(run_dir),
    }


def _stop_once_trained_on(proc: subprocess.Popen[Any], run_dir: Path, steps: int) -> None:
    """Once some worker's log holds `steps` commits of generation 2, ask for the job's stop."""
    def trained_on() -> bool:
        time.sleep(0.5)  # the logs are read whole: not 50 times a second beside the job
        if proc.poll() is not None:
            return True  # ended by itself: the test says what went wrong
        return any(sum(r.generation == 2 for r in log) >= steps for log in step_logs(run_dir).values())

    wait_for(trained_on, timeout=240, what=f"{steps} steps of generation 2")
    if proc.poll() is None:
        drain = subprocess.run([sys.executable, "-m", "elastic.cli", "drain", "--all", "--run-dir", str(run_dir),
                                "--wait", "0"], capture_output=True, text=True, timeout=60, check=False)
        assert drain.returncode == 0, drain.stdout + drain.stderr


def _flag(fault: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in fault.items())


def _failure_free(factory: pytest.TempPathFactory, steps: int) -> dict[str, Any]:
    """The failure-free result of the same job (tiny, global batch 8 in microbatches of 2, the CLI's
    optimizer) after `steps` steps: one worker stands for any plan (DESIGN.md invariant 1), and the
    run is shared with the fault tests of as many steps."""
    summary, state = reference_run(factory, steps=steps)
    return {"summary": {"losses": summary.losses}, "state": state}


@pytest.fixture(scope="module")
def sick_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`_failure_free` of SICK_STEPS steps."""
    return _failure_free(tmp_path_factory, SICK_STEPS)


@pytest.fixture(scope="module")
def sick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _launch(tmp_path_factory.mktemp("netns-sick"), SICK_STEPS, "--sick-link", _flag(SICK))


@pytest.fixture(scope="module")
def one_way_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _launch(tmp_path_factory.mktemp("netns-oneway"), LONG_STEPS, "--partition", _flag(ONE_WAY),
                   stop_after_gen2=TRAINED_ON)


def _check_against_failure_free(run: dict[str, Any], reference: dict[str, Any], *, code: int = 0) -> None:
    """Every step committed, the same losses and final parameters as the failure-free launch (1e-5),
    no worker restarted, and nothing of the launch left behind; exit `code` (3: stopped on request)."""
    assert run["code"] == code, run["out"][-3000:]
    summary, ref = run["summary"], reference["summary"]
    steps = len(reference["summary"]["losses"])
    assert summary["steps_committed"] == steps and len(summary["losses"]) == steps
    for step, (got, want) in enumerate(zip(summary["losses"], ref["losses"], strict=True)):
        assert abs(got - want) <= TOLERANCE * abs(want), f"step {step + 1}: loss {got} vs failure-free {want}"
    diff = max_rel_diff(run["state"], reference["state"])
    assert diff <= TOLERANCE, f"final state differs from the failure-free run by {diff:.2e}"
    assert summary["worker_restarts"] == 0
    prefix = run["netns"]["prefix"]
    assert _leftovers(prefix) == []
    procs = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert f"netns-{prefix}" not in procs and f"{prefix}h" not in procs  # no agent, worker or relay left


def _reasons(summary: dict[str, Any]) -> list[tuple[int, list[int], list[int], str]]:
    """Each generation change of a run: (generation, lost, joined, reason), for a failure's message."""
    return [(r["generation"], r["lost_nodes"], r["joined_nodes"], r["reason"]) for r in summary["recoveries"]]


def _committed_once(logs: dict[str, list[StepResult]], generations: list[int], *, fenced: str | None = None) -> None:
    """Each step was committed by one generation only, the one the summary names, and every log
    that holds a step holds the same loss for it: no step committed twice or by a fenced node.

    One exception, for the `fenced` node's log: the vote of the step in flight at the loss can
    complete on the fenced node and be cut short on every survivor (a collective ends at
    different moments on its ranks). No survivor saw it complete, so the leader drops it and
    generation 2 replays that step (tests/faults/test_leader.py: a vote no survivor saw complete
    is dropped); the fenced node's log then holds it in generation 1, with the same loss."""
    by_step: dict[int, set[tuple[int, float]]] = {}
    for name, results in logs.items():
        for r in results:
            if name == fenced and r.generation == 1 and r.step < len(generations) and generations[r.step] == 2:
                assert r.step == generations.index(2), (r.step, "a fenced node's commit after the resumed step")
                continue  # checked against the survivors' loss below
            by_step.setdefault(r.step, set()).add((r.generation, r.loss))
    assert sorted(by_step) == list(range(len(generations)))
    for step, seen in by_step.items():
        assert len(seen) == 1 and next(iter(seen))[0] == generations[step], (step, seen)
    if fenced is not None:
        for r in logs.get(fenced, []):
            if r.generation == 1 and r.step < len(generations) and generations[r.step] == 2:
                assert {r.loss} == {loss for _, loss in by_step[r.step]}, (r, by_step[r.step])


@needs_netns
@pytest.mark.slow
@pytest.mark.soak  # about a minute; a slow node's no false failure: tests/faults/test_slow_node.py
@pytest.mark.timeout(600)
def test_sick_link_causes_no_false_failure(sick_run: dict[str, Any], sick_reference: dict[str, Any]) -> None:
    _check_against_failure_free(sick_run, sick_reference)
    summary = sick_run["summary"]
    assert summary["recoveries"] == [], _reasons(summary)  # no node lost, no generation change
    assert summary["step_generations"] == [1] * SICK_STEPS
    _committed_once(sick_run["logs"], summary["step_generations"])
    (sick,) = sick_run["partitions"]
    assert (sick["node"], sick["mode"], sick["delay_ms"], sick["loss"]) == (2, "sick", 50.0, 1.0)
    assert sick["up_at"] - sick["down_at"] >= SICK["seconds"]
    # Training went on over the sick link: steps were committed while it was sick.
    during = [t for t in summary["step_committed_at"] if sick["down_at"] < t < sick["up_at"]]
    assert during, "no step committed while the link was sick"


@needs_netns
@pytest.mark.slow
@pytest.mark.soak  # about a minute; the one-way case by lease: tests/roles/test_leader_suspects.py, a fence: tests/faults/test_partition.py
@pytest.mark.timeout(600)
def test_one_way_partitioned_node_is_fenced(one_way_run: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> None:
    summary = one_way_run["summary"]
    assert summary is not None, one_way_run["out"][-3000:]
    assert "stopped on request after step" in one_way_run["out"], one_way_run["out"][-3000:]
    _check_against_failure_free(one_way_run, _failure_free(tmp_path_factory, summary["steps_committed"]), code=3)
    (cut,) = one_way_run["partitions"]
    assert cut["node"] == ONE_WAY["node"] and cut["mode"] == "oneway"
    # Lost once, while its packets to etcd were dropped; the survivors re-planned and trained on.
    assert len(summary["recoveries"]) == 1, _reasons(summary)
    (recovery,) = summary["recoveries"]
    assert recovery["lost_nodes"] == [ONE_WAY["node"]] and recovery["generation"] == 2
    assert cut["down_at"] < recovery["detected_at"] < cut["up_at"]
    gens = summary["step_generations"]
    assert gens == sorted(gens) and set(gens) == {1, 2} and gens.count(2) >= TRAINED_ON, gens
    _committed_once(one_way_run["logs"], gens, fenced=f"node{ONE_WAY['node']}.worker0.jsonl")
    # It still heard its peers: it committed steps of generation 1 after the cut (gloo did not need
    # etcd), and nothing once the survivors trained on without it. The step in flight when the
    # leader detected the loss may end after that moment, in generation 1 on every node
    # (_committed_once), so the fence is the survivors' first commit of generation 2.
    node_log = one_way_run["logs"][f"node{ONE_WAY['node']}.worker0.jsonl"]
    assert [r for r in node_log if r.committed_at > cut["down_at"]], "the node stopped training at the cut"
    first_gen2 = min(t for t, g in zip(summary["step_committed_at"], gens, strict=True) if g == 2)
    assert all(r.generation == 1 and r.committed_at < first_gen2 for r in node_log), node_log[-3:]


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
    addresses = sorted(n["address"] for n in netns["nodes"].values())
    assert addresses == [netns["etcd"].split(":")[0].rsplit(".", 1)[0] + f".{10 + k}" for k in range(3)]
    # --check: each namespace's probe reduced over gloo and fetched a shard over gRPC from its
    # neighbour's namespace address, before the job started.
    probes = [line for line in partitioned_run["out"].splitlines() if line.startswith("netns: probe rank")]
    assert len(probes) == 3, partitioned_run["out"][-3000:]
    for line in probes:
        assert "gloo all_reduce 6 ok" in line and "gRPC fetch from 10.213." in line, line
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
@pytest.mark.parametrize("flags, message", [
    (["--sick-link", "node=2,step=3,seconds=5,delay=-1"], "delay must be in 0..10000 ms"),
    (["--sick-link", "node=2,step=3,seconds=5"], "needs delay=MS or loss=PERCENT"),
    (["--sick-link", "node=2,step=3,seconds=5,loss=150%"], "loss must be in 0..100"),
    (["--partition", "node=2,step=3,seconds=5,mode=sideways"], "mode must be down or oneway"),
    (["--sick-link", "node=7,step=3,seconds=5,delay=50"], "--sick-link node 7 is not a node of the plan"),
])
def test_bad_fault_flags_exit_2_with_one_line(flags: list[str], message: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # In this process, as root with namespaces available (patched): the flags are refused before
    # anything is built.
    monkeypatch.syspath_prepend(str(LAUNCH.parent))
    spec = importlib.util.spec_from_file_location("netns_launch", LAUNCH)
    assert spec is not None and spec.loader is not None
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    monkeypatch.setattr(launch, "check_available", lambda: None)
    code = launch.main(["--nodes", "3", "--steps", "8", "--run-dir", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().count("\n") == 0 and message in err, err
    assert list(tmp_path.iterdir()) == []  # nothing built, nothing written


@pytest.mark.timeout(60)
def test_not_root_exits_2_with_one_line() -> None:
    code = "import os; os.geteuid = lambda: 1000; import runpy, sys; sys.argv = ['launch.py']; " \
           f"runpy.run_path({str(LAUNCH)!r}, run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           cwd=LAUNCH.parent)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "needs root" in proc.stderr
