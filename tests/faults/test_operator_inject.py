"""`elastic inject` / `elastic drain` against a job in a real etcd: what they refuse (with one clear
line, and without writing anything) and the request they write. The job here is etcd state
only (config, token, members with real leases, the progress record); the live runs of
test_slow_node.py and test_partition.py show the requests carried out."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic.cli.main import main
from elastic.coordinator import EtcdServer, JobKeys, Membership, MembershipConfig, NodeIdentity, admit
from elastic.coordinator.generations import Generations
from elastic.coordinator.keys import RunKeys
from elastic.records.generation import GenerationRecord
from elastic.records.injection_requests import read_requests
from elastic.records.progress import ProgressRecord
from elastic.records.workers import node_id

from .runs import tiny_config

pytestmark = pytest.mark.timeout(60)

TOKEN = "s3cret"


@pytest.fixture
def job_dir(client: Any, job: str, etcd_server: EtcdServer, tmp_path: Path) -> Iterator[Path]:
    """A job with nodes 0 (incarnation 0) and 1 (incarnation 2) alive, 3 of 10 steps committed,
    and `<dir>/job.json` as `elastic run` writes it."""
    keys, rk = JobKeys(job), RunKeys(JobKeys(job))
    config = tiny_config(tmp_path, nodes=2, pipelines=2, steps=10)
    admit(client, keys, TOKEN)
    client.put(rk.config, config.to_json())
    members = []
    for node, inc in ((0, 0), (1, 2)):
        m = Membership(client, keys, NodeIdentity(node_id=node_id(node), incarnation=inc, address="127.0.0.1:0",
                       devices=1), config=MembershipConfig(ttl=5))
        m.join()
        members.append(m)
    record = GenerationRecord(plan=config.spec.plan, resume_step=0, incarnations={0: 0, 1: 2})
    Generations(client, keys).publish(record.to_json(), expected=0)
    progress = ProgressRecord(step=2, loss=1.0, grad_norm=1.0, lr=1e-3, seconds=0.1, generation=1, committed_at=0.0)
    client.put(rk.progress, progress.to_json())  # steps 0-2 committed
    (tmp_path / "job.json").write_text(json.dumps({"etcd": etcd_server.endpoint, "job": job, "token": TOKEN}))
    try:
        yield tmp_path
    finally:
        for m in members:
            m.leave()


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["inject", "kill", "--node", "5"], 1, "node 5 is not a live member of job"),
        (
            ["inject", "kill", "--node", "1", "--at-step", "2"],
            1,
            "step 2 is already committed (step 4 is in flight)",
        ),
        (["inject", "hang", "--node", "1", "--at-step", "11"], 1, "past the job's last step 10"),
        (["inject", "partition", "--node", "1", "--seconds", "2"], 1, "would go unnoticed (lease TTL 3 s)"),
        (["inject", "kill", "--node", "1", "--token", "wrong"], 1, "wrong job token"),
        (["inject", "kill", "--node", "1", "--job", "no-such-job"], 1, "job no-such-job not found"),
        (["inject", "kill", "--node", "1", "--factor", "3"], 2, "--factor applies to slow only"),
        (["inject", "slow", "--node", "1", "--factor", "1"], 2, "--factor must be > 1"),
        (["inject", "slow", "--node", "1", "--steps", "5", "--seconds", "3"], 2, "applies to slow only, instead of --seconds"),
        (["inject", "kill", "--node", "1", "--steps", "5"], 2, "--steps N (N >= 1) applies to slow only"),
        (["inject", "slow", "--node", "1", "--steps", "0"], 2, "--steps N (N >= 1) applies to slow only"),
        (["inject", "kill", "--node", "1", "--no-hold-cpu"], 2, "--hold-cpu applies to slow only"),
        (["inject", "kill", "--node", "1", "--at-step", "0"], 2, "--at-step must be >= 1"),
        (["drain", "--node", "4"], 1, "node 4 is not in generation 1"),
        (["drain", "--node", "1", "--token", "wrong"], 1, "wrong job token"),
    ],
)
def test_refusals_write_nothing(job_dir: Path, client: Any, job: str, capsys: pytest.CaptureFixture[str],
                                argv: list[str], code: int, message: str) -> None:
    got, out = cli(capsys, *argv, "--run-dir", str(job_dir), "--wait", "0")
    assert got == code and message in out and len(out.strip().splitlines()) == 1, out
    assert read_requests(client, JobKeys(job).root) == []


def test_writes_a_request_for_the_current_incarnation(
    job_dir: Path, client: Any, job: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = cli(capsys, "inject", "slow", "--node", "1", "--at-step", "5", "--factor", "3", "--run-dir",
                    str(job_dir), "--wait", "0")
    assert code == 0, out
    (req,) = read_requests(client, JobKeys(job).root)
    assert (req.kind, req.node, req.incarnation, req.when, req.step, req.factor, req.seconds) == (
        "slow", 1, 2, "step", 5, 3.0, 10.0
    )
    assert req.id.startswith("slow-node1-step5-") and req.id in out and req.hold_cpu and req.steps is None
    code, out = cli(capsys, "inject", "slow", "--node", "1", "--steps", "30", "--no-hold-cpu", "--run-dir",
                    str(job_dir), "--wait", "0")
    assert code == 0 and "(x2 for 30 steps)" in out, out
    by_steps = [r for r in read_requests(client, JobKeys(job).root) if r.id != req.id]
    assert [(r.steps, r.seconds, r.hold_cpu) for r in by_steps] == [(30, None, False)]
    client.delete(f"{JobKeys(job).root}injections/{by_steps[0].id}")
    code, out = cli(capsys, "drain", "--node", "0", "--run-dir", str(job_dir), "--wait", "0")
    assert code == 0 and "drain node 0 (incarnation 0)" in out, out
    assert sorted(r.kind for r in read_requests(client, JobKeys(job).root)) == ["drain", "slow"]
