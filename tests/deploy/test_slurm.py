"""deploy/slurm/elastic.sbatch submitted with `sbatch` to a real slurmctld and two real slurmd.

The cluster (tests/deploy/slurm_cluster.py): munged, slurmctld and two slurmd of Debian's SLURM
22.05, each slurmd in a network namespace of its own (deploy/netns) with its own hostname and
address, as root. The batch script runs unchanged; what a user sets is given the way the script
reads it (VENV, RUN_DIR, RUN_FLAGS in the environment, `--nodes=2` on the sbatch line: the line
deploy/slurm/README.md shows). It trains tiny on the 2-node allocation with f = 1 on the etcd the
script starts on the first node; every job is compared with a plain `elastic run` of the same
job (2 simulated nodes on this machine): final parameters within 1e-5, losses too.

- No fault: the job ends COMPLETED in `squeue --states=all` and in `sacct --completion` (no
  slurmdbd here: accounting_storage/none with jobcomp/filetxt, so sacct reads the job-completion
  record, whose JobState is checked too). Node 1 is drained through SLURM (`scontrol update
  state=drain`) mid-run: a SLURM drain only keeps new jobs off a node, the script does not turn
  it into the runtime's drain, and the job trains on it to the end with no recovery.
- Node 1's job step killed at step 8: the PIDs of its torchrun task and everything under it, as
  `scontrol listpids` has them from that node's slurmstepd, are SIGKILLed when step 8 is in
  flight (timed with the runtime's own step trigger, InjectionTrigger, as `--inject kill` is).
  srun reports the task killed, node 0 trains on in generation 2 without a restart, and the job
  still ends COMPLETED with the plain run's final state. `soak` (about 45 s): the suite's
  default runs the first case.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.coordinator import EtcdConfig, JobKeys, connect
from elastic.roles.injection_trigger import InjectionTrigger
from tests.deploy.slurm_cluster import SlurmCluster, start_cluster, stop_pid, wait_file_line
from tests.polling import wait_for

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "elastic.sbatch"
VENV = Path(sys.prefix)
"""The project's virtualenv (the script's VENV): this interpreter's."""
NODES = 2
STEPS = 12
KILL_STEP = 8
RUN_FLAGS = (f"--model tiny --fault-tolerance 1 --global-batch 16 --microbatch 2 --steps {STEPS} "
             "--checkpoint-every 5 --lease-ttl 5 --straggler-policy report")
"""`elastic run` flags of every job here (RUN_FLAGS of the script; the plain run adds --nodes).
Stragglers are reported, not acted on: the tests count generations, and a rebalance for a node
slowed by a loaded machine would add one."""
TOLERANCE = 1e-5
JOB_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A running two-node cluster for the module; every daemon stopped by PID afterwards."""
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"), nodes=NODES)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A plain `elastic run` of the same job (2 simulated nodes, embedded etcd): summary, final state."""
    run_dir = tmp_path_factory.mktemp("plain") / "run"
    cmd = [str(VENV / "bin" / "elastic"), "run", *RUN_FLAGS.split(), "--nodes", str(NODES),
           "--gpus-per-node", "1", "--no-report", "--run-dir", str(run_dir), "--final-state", str(run_dir / "final_state.pt")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        if proc.poll() is None:  # timed out (or interrupted): it and its agents, by PID
            stop_pid(proc.pid, grace_s=5.0)
            proc.wait()
    assert proc.returncode == 0, out
    return _outcome(run_dir)


def _outcome(run_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A run's summary.json and its final_state.pt (canonical name -> fp32 tensor)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary, torch.load(run_dir / "final_state.pt", map_location="cpu", weights_only=True)


def max_abs_diff(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest |state - reference| over every element of every parameter (same names required)."""
    assert state.keys() == reference.keys()
    return max(float((state[name] - ref).abs().max()) for name, ref in reference.items())


def submit(cluster: SlurmCluster, workdir: Path) -> tuple[int, Path]:
    """`sbatch --nodes=2 deploy/slurm/elastic.sbatch` from `workdir`, with VENV, RUN_DIR and
    RUN_FLAGS in the environment (the line deploy/slurm/README.md shows); the job id and its run dir."""
    cluster.wait_idle(60.0)  # a job submitted while an earlier one completes waits for the scheduler
    workdir.mkdir()
    run_dir = workdir / "run"
    env = cluster.env({"VENV": str(VENV), "RUN_DIR": str(run_dir),
                       "RUN_FLAGS": f"{RUN_FLAGS} --final-state {run_dir}/final_state.pt"})
    out = cluster.client("sbatch", "--parsable", f"--nodes={NODES}", str(SBATCH), cwd=workdir, env=env)
    return int(out.strip().split(";")[0]), run_dir


def job_etcd(workdir: Path, job: int) -> tuple[str, Any]:
    """The job's id in etcd and a client of the etcd the script started (from its first line)."""
    line = wait_file_line(workdir / f"elastic-{job}.out", r"elastic: job (\S+), etcd (\S+),", 60.0)
    return line.group(1), connect(EtcdConfig(endpoint=line.group(2)))


def check_ended_completed(cluster: SlurmCluster, job: int, workdir: Path) -> None:
    """squeue, sacct and the job-completion record all say COMPLETED once the job ends."""
    state = cluster.wait_ended(job, JOB_TIMEOUT_S)
    record = cluster.jobcomp_record(job)
    states = (state, cluster.sacct_state(job), record.get("JobState"))
    print(f"job {job}: squeue {states[0]}, sacct {states[1]}, job-completion record {states[2]}")
    out = workdir / f"elastic-{job}.out"
    assert states == ("COMPLETED",) * 3, (record, out.read_text()[-4000:] if out.exists() else "no output")
    assert record.get("NodeCnt") == str(NODES), record


def check_same_as_plain(run_dir: Path, plain: tuple[dict[str, Any], dict[str, torch.Tensor]]) -> float:
    """Every step committed, losses and final parameters within TOLERANCE of the plain run, no
    worker restarted; the final state's max abs difference."""
    (summary, state), (ref_summary, ref_state) = _outcome(run_dir), plain
    assert summary["steps_committed"] == STEPS
    for step, (got, want) in enumerate(zip(summary["losses"], ref_summary["losses"], strict=True), start=1):
        assert abs(got - want) <= TOLERANCE * abs(want), f"step {step}: loss {got} vs plain run {want}"
    diff = max_abs_diff(state, ref_state)
    print(f"final state vs plain elastic run: max abs diff {diff:.3e}")
    assert diff <= TOLERANCE, f"final state differs from the plain elastic run by {diff:.2e}"
    assert summary["worker_restarts"] == 0
    assert all(len(pids) == 1 for pids in summary["worker_pids"].values()), summary["worker_pids"]
    return diff


@pytest.mark.timeout(300)
def test_sbatch_job_equals_a_plain_elastic_run_and_a_slurm_drain_leaves_it_running(
    slurm: SlurmCluster, plain_run: tuple[dict[str, Any], dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    job, run_dir = submit(slurm, tmp_path / "job")
    job_id, client = job_etcd(tmp_path / "job", job)
    node = slurm.nodes[1]
    try:
        trigger = InjectionTrigger(client, JobKeys(job_id))
        try:
            with trigger.watching():
                wait_for(lambda: trigger.in_flight() >= 4, 60.0, "step 4 in flight")
                slurm.client("scontrol", "update", f"nodename={node}", "state=drain", "reason=elastic-test")
                assert slurm.node_states()[node] in ("drng", "drain")
        finally:
            trigger.close()
        check_ended_completed(slurm, job, tmp_path / "job")
        wait_for(lambda: slurm.node_states()[node] == "drain", 30.0, f"{node} drained once the job left it")
    finally:
        client.close()
        slurm.client("scontrol", "update", f"nodename={node}", "state=resume")
    check_same_as_plain(run_dir, plain_run)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["recoveries"] == [] and set(summary["step_generations"]) == {1}, summary["step_generations"]


def kill_node_step_at(cluster: SlurmCluster, job: int, job_id: str, client: Any, node: str) -> tuple[list[int], int]:
    """SIGKILL every PID of job step JOB.0 on `node` (`scontrol listpids`, read while step
    KILL_STEP - 2 is in flight) as soon as step KILL_STEP is in flight, then any PID that
    listpids still shows; the PIDs, and the step in flight when the first signals went."""
    trigger = InjectionTrigger(client, JobKeys(job_id))
    try:
        with trigger.watching():
            wait_for(lambda: trigger.in_flight() >= KILL_STEP - 2, 60.0, f"step {KILL_STEP - 2} in flight")
            pids = cluster.step_pids(f"{job}.0", node)
            assert len(pids) >= 3, pids  # the task (torchrun), the agent, the worker
            wait_for(lambda: trigger.in_flight() >= KILL_STEP, 60.0, f"step {KILL_STEP} in flight")
            sigkill(pids)
            in_flight = trigger.in_flight()
    finally:
        trigger.close()
    wait_for(lambda: not sigkill(_still_listed(cluster, f"{job}.0", node)), 15.0, f"no process of {job}.0 on {node}")
    return pids, in_flight


def sigkill(pids: list[int]) -> list[int]:
    """SIGKILL each of `pids` that still exists; those it was sent to."""
    sent = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            sent.append(pid)
    return sent


def _still_listed(cluster: SlurmCluster, step: str, node: str) -> list[int]:
    """The PIDs `scontrol listpids` still has for `step` on `node` (none once the step left it)."""
    try:
        return cluster.step_pids(step, node)
    except AssertionError:  # listpids fails once the node's slurmstepd for the step is gone
        return []


@pytest.mark.soak  # about 45 s; a killed node's recovery under torchrun: tests/coordinator/test_torchrun.py
@pytest.mark.timeout(300)
def test_node_step_killed_through_slurm_recovers_without_restarting_the_other(
    slurm: SlurmCluster, plain_run: tuple[dict[str, Any], dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    job, run_dir = submit(slurm, tmp_path / "job")
    job_id, client = job_etcd(tmp_path / "job", job)
    try:
        pids, in_flight = kill_node_step_at(slurm, job, job_id, client, slurm.nodes[1])
        print(f"SIGKILLed {slurm.nodes[1]}'s step {job}.0 PIDs {pids} while step {in_flight} was in flight")
        assert in_flight == KILL_STEP, f"the kill landed while step {in_flight} was in flight"
        check_ended_completed(slurm, job, tmp_path / "job")
    finally:
        client.close()
    out = (tmp_path / "job" / f"elastic-{job}.out").read_text()
    assert re.search(r"srun: error: \S+: task 1: Killed", out), out
    check_same_as_plain(run_dir, plain_run)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(summary["recoveries"]) == 1, summary["recoveries"]
    print("recovery:", summary["recoveries"][0])
    assert summary["step_generations"][: KILL_STEP - 1] == [1] * (KILL_STEP - 1)
    assert set(summary["step_generations"][KILL_STEP - 1:]) == {2}, summary["step_generations"]
