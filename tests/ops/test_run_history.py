"""The history of a run in its run directory (elastic/ops/run_history.py), on a real etcd: what
the launcher saves at the end reads back as the same events and status; where it saved nothing
(SIGKILL), a copy of the etcd's data directory gives the same events; a live launcher's run is
never read as ended; and how a run ended is named from what ends it."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

import pytest

from elastic.cli.run_guard import ending
from elastic.coordinator import EtcdConfig, EtcdServer, connect
from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.etcd_cluster import EtcdCluster
from elastic.coordinator.events import record_event
from elastic.coordinator.generations import Generations
from elastic.coordinator.keys import JobKeys
from elastic.coordinator.membership import NodeIdentity
from elastic.ops.events import HistoryEvent
from elastic.ops.run_history import find_ended_run, save_history, snapshot
from elastic.ops.status import JobStatus
from elastic.records.generation import GenerationRecord
from elastic.records.run_end import RunEnd
from elastic.records.summary import RunSummary
from elastic.roles.interrupt import Interrupted
from elastic.roles.job_stop import JobStopped, StopOutcome
from elastic.roles.launch_errors import JobFailed
from elastic.roles.launcher import write_job_file
from templates.plan import even_plan

from .test_run_lock import HOLD

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

JOB = "history-job"


def _write_job(client: EtcdClient, keys: JobKeys) -> None:
    """A small job: two joins, generation 1, a failure, and a live member on a lease."""
    plan = even_plan(num_layers=6, nodes=[0, 1], num_pipelines=2, global_microbatches=4, microbatch_size=2)
    for node in (0, 1):
        record_event(client, keys, who=f"node{node}", kind="join", incarnation=0)
    first = GenerationRecord(plan=plan, resume_step=0, incarnations={0: 0, 1: 0}, published_at=1.0)
    Generations(client, keys).publish(first.to_json(), expected=0)
    record_event(client, keys, who="node1", kind="failure", node="node1", incarnation=0,
                 reason="worker pid 1 exited with code -9")
    lease = client.lease(30)
    member = NodeIdentity(node_id="node0", incarnation=0, address="127.0.0.1:1", devices=1)
    client.put(keys.member("node0"), member.to_json(), lease=lease.id)


def _lines(events: list[HistoryEvent]) -> list[str]:
    return [e.to_json() for e in events]


def test_saved_and_recovered_histories_read_as_the_live_one(tmp_path: Path) -> None:
    run_dir, keys = tmp_path / "run", JobKeys(JOB)
    server = EtcdServer(data_dir=run_dir / "etcd").start()  # where the launcher's own etcd keeps its data
    try:
        client = connect(EtcdConfig(endpoint=server.endpoint))
        _write_job(client, keys)
        live_events, live_status = snapshot(client, keys, etcd=server.endpoint)
        write_job_file(run_dir, etcd=server.endpoint, job=JOB, token="t")
        assert find_ended_run(run_dir, job=JOB, etcd=server.endpoint, etcd_answers=lambda: True) is None
        client.close()
    finally:
        server.stop(kill=True)  # as a SIGKILLed launcher's etcd dies with it

    recovered = find_ended_run(run_dir, job=JOB, etcd=server.endpoint, etcd_answers=lambda: False)
    assert recovered is not None and recovered.end.how == "launcher gone" and recovered.end.source == "etcd copy"
    assert _lines(recovered.events) == _lines(live_events) and [e.kind for e in live_events] == [
        "join", "join", "generation", "failure"]
    assert recovered.status.ended == recovered.end.to_dict() and recovered.status.etcd == server.endpoint
    assert [n.alive for n in recovered.status.nodes] == [False, False]  # its leases revoked: nothing is alive
    assert [n.alive for n in live_status.nodes] == [True, False]
    assert not (run_dir / "history").exists()  # a reader writes nothing into the run directory

    end = RunEnd(how="failed", detail="the leader gave up", at=2.0, launcher_pid=12345)
    save_history(run_dir, events=live_events, status=live_status, end=end)
    saved = find_ended_run(run_dir, job=JOB, etcd=server.endpoint, etcd_answers=lambda: False)
    assert saved is not None and saved.end == end
    assert _lines(saved.events) == _lines(live_events)
    assert saved.status == dataclasses.replace(live_status, ended=end.to_dict())
    assert sorted(p.name for p in (run_dir / "history").iterdir()) == ["end.json", "events.json", "status.json"]


def test_a_killed_etcd_cluster_is_read_back_from_its_most_advanced_member(tmp_path: Path) -> None:
    """`elastic run --etcd-members 3`: a follower may not know of the last writes as committed
    (its copy alone would lose them); the member copy with the latest revision has them all."""
    run_dir, keys = tmp_path / "run", JobKeys(JOB)
    cluster = EtcdCluster(3, data_dir=run_dir / "etcd").start()
    try:
        client = connect(EtcdConfig(endpoint=cluster.endpoint))
        _write_job(client, keys)
        for i in range(10):
            record_event(client, keys, who="node0", kind="probe", i=i)
        live_events, _ = snapshot(client, keys, etcd=cluster.endpoint)
        client.close()
        time.sleep(0.5)  # heartbeats carry the commit index to every member (module doc: the last 0.1 s)
    finally:
        for member in range(3):
            cluster.kill(member)
    recovered = find_ended_run(run_dir, job=JOB, etcd=cluster.endpoint, etcd_answers=lambda: False)
    assert recovered is not None and _lines(recovered.events) == _lines(live_events)
    assert "/member-" in recovered.end.detail


def test_an_earlier_runs_history_is_not_the_end_of_a_later_run(tmp_path: Path) -> None:
    """A live launcher holds the lock: an earlier run's history there is not this run's end; nor
    is it once that launcher was killed (its record is newer); the end it wrote itself is."""
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        old = RunEnd(how="finished", at=1.0, launcher_pid=holder.pid + 1)
        status = JobStatus(job=JOB, etcd="127.0.0.1:1", read_at=1.0, state="finished", fatal=None, leader=None,
                           generation=1, generation_reason="start", resume_step=0, committed_steps=2,
                           reported_steps=2, total_steps=2, last_loss=1.0, lease_ttl_s=3, global_batch=8,
                           microbatch_size=2, seq_len=64, nodes=[], pipelines=[], throughput=None, recoveries=0,
                           last_recovery=None)
        save_history(run_dir, events=[], status=status, end=old)
        assert find_ended_run(run_dir, job=JOB, etcd="127.0.0.1:1", etcd_answers=lambda: False) is None
        ours = RunEnd(how="failed", at=time.time(), launcher_pid=holder.pid)
        save_history(run_dir, events=[], status=dataclasses.replace(status, committed_steps=1), end=ours)
        found = find_ended_run(run_dir, job=JOB, etcd="127.0.0.1:1", etcd_answers=lambda: False)
        assert found is not None and found.end == ours and found.status.committed_steps == 1  # wrote its end
        save_history(run_dir, events=[], status=status, end=old)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        # killed without an end: not the earlier history; no etcd data here, so its job.json's etcd is read
        assert find_ended_run(run_dir, job=JOB, etcd="127.0.0.1:1", etcd_answers=lambda: False) is None
        (run_dir / "launcher.lock").unlink()  # no launcher since that history was written
        found = find_ended_run(run_dir, job=JOB, etcd="127.0.0.1:1", etcd_answers=lambda: False)
        assert found is not None and found.end == old and found.status.committed_steps == 2
    finally:
        holder.kill()
        holder.wait()


def test_how_a_run_ended_is_named_from_what_ended_it() -> None:
    status = JobStatus(job=JOB, etcd="e", read_at=1.0, state="running", fatal=None, leader=None, generation=1,
                       generation_reason="start", resume_step=0, committed_steps=3, reported_steps=3, total_steps=6,
                       last_loss=None, lease_ttl_s=3, global_batch=8, microbatch_size=2, seq_len=64, nodes=[],
                       pipelines=[], throughput=None, recoveries=0, last_recovery=None)
    done = dataclasses.replace(status, committed_steps=6, state="finished")
    outcome = StopOutcome(step=3, generation=1, by="sigterm", checkpoint_dir="c", complete=True)
    cases: list[tuple[BaseException | None, JobStatus, str, str]] = [
        (None, done, "finished", "6/6 steps committed"),
        (None, status, "stopped", "returned before the last step"),
        (JobStopped(outcome, cast(RunSummary, None)), status, "stopped", "on request (SIGTERM) at step 3"),
        (JobFailed("the leader gave up: no plan\nlog tail"), status, "failed", "the leader gave up: no plan; 3/6"),
        (TimeoutError("job did not finish within 9 s"), status, "timed out", "within 9 s"),
        (KeyboardInterrupt(), status, "interrupted", "Ctrl-C"),
        (SystemExit(128 + signal.SIGTERM), status, "terminated", "SIGTERM"),
        (SystemExit(1), status, "exited", "exit code 1"),
        # a stop at once that the launcher raised for its signal (elastic/roles/interrupt.py): as the signal's own
        (Interrupted(signal.SIGINT), status, "interrupted", "Ctrl-C"),
        (Interrupted(signal.SIGTERM), status, "terminated", "SIGTERM"),
        (Interrupted(signal.SIGHUP), status, "exited", f"exit code {128 + signal.SIGHUP}"),
        (ValueError("bug"), status, "crashed", "ValueError: bug"),
    ]
    for exc, st, how, says in cases:
        end = ending(exc, st)
        assert end.how == how and says in end.detail, (exc, end)
        assert end.describe().startswith(f"the run has ended: {how}")
