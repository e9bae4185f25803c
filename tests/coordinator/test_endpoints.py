"""Endpoint lists: `HOST:PORT[,HOST:PORT...]` parsed and checked by `EtcdConfig`, carried by
job.json (old single-endpoint files still load), and `elastic run --etcd/--etcd-members` refused
with one line when wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic.cli.main import main
from elastic.coordinator import EtcdConfig
from elastic.coordinator.client import parse_endpoints
from elastic.coordinator.etcd_cluster import check_member_count
from elastic.ops.job_target import resolve_target
from elastic.roles.launcher import write_job_file

pytestmark = pytest.mark.timeout(30)


def test_a_list_is_parsed_in_order() -> None:
    config = EtcdConfig(endpoint="10.0.0.1:2379, etcd-1.svc:2380,[::1]:2381")
    assert config.endpoints == (("10.0.0.1", 2379), ("etcd-1.svc", 2380), ("[::1]", 2381))
    assert (config.host, config.port) == ("10.0.0.1", 2379)  # the first member
    single = EtcdConfig(endpoint="127.0.0.1:2379")
    assert single.endpoints == (("127.0.0.1", 2379),) and (single.host, single.port) == ("127.0.0.1", 2379)


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("127.0.0.1:2379,", "''"),
        ("127.0.0.1:2379,,127.0.0.1:2380", "''"),
        ("127.0.0.1:2379,127.0.0.1", "'127.0.0.1'"),
        ("127.0.0.1:2379,:2380", "':2380'"),
        ("127.0.0.1:2379,127.0.0.1:http", "'127.0.0.1:http'"),
        ("127.0.0.1:0", "'127.0.0.1:0'"),
        ("127.0.0.1:65536", "'127.0.0.1:65536'"),
    ],
)
def test_a_bad_member_is_named(text: str, bad: str) -> None:
    with pytest.raises(ValueError, match="host:port") as info:
        EtcdConfig(endpoint=text)
    assert f"got {bad} in" in str(info.value), str(info.value)
    with pytest.raises(ValueError):
        parse_endpoints(text)


def test_a_member_listed_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        EtcdConfig(endpoint="127.0.0.1:2379,127.0.0.1:2379")


def test_job_file_carries_the_list_and_old_files_load(tmp_path: Path) -> None:
    new = tmp_path / "new"
    new.mkdir()
    write_job_file(new, etcd="127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", job="j1", token="t")
    data = json.loads((new / "job.json").read_text())
    assert data["etcd_endpoints"] == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    assert data["etcd"] == "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"  # what older readers read
    assert resolve_target(etcd=None, job=None, run_dir=str(new)).etcd == "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"
    old = tmp_path / "old"
    old.mkdir()
    (old / "job.json").write_text('{"etcd": "127.0.0.1:2379", "job": "j0", "token": "t"}')  # before lists
    target = resolve_target(etcd=None, job=None, run_dir=str(old))
    assert (target.etcd, target.job) == ("127.0.0.1:2379", "j0")
    # --etcd on the command line still overrides the file
    assert resolve_target(etcd="127.0.0.1:9", job=None, run_dir=str(new)).etcd == "127.0.0.1:9"


def test_a_bad_list_in_the_cli_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["status", "--etcd", "127.0.0.1:2379,nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'nope'" in err, err


@pytest.mark.parametrize("members", [0, 2, 4, 9, -1])
def test_member_count_must_be_odd_and_at_most_7(members: int) -> None:
    with pytest.raises(ValueError, match="odd and in 1..7"):
        check_member_count(members)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--etcd-members", "2"], "odd and in 1..7"),
        (["--etcd-members", "9"], "odd and in 1..7"),
        (["--etcd-members", "3", "--etcd", "127.0.0.1:2379"], "cannot go with --etcd"),
        (["--etcd-members", "3", "--static"], "cannot go with --etcd or --static"),
        (["--etcd", "127.0.0.1:2379,127.0.0.1"], "'127.0.0.1'"),
    ],
)
def test_run_refuses_bad_etcd_flags_and_writes_nothing(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    code = main(["run", "--model", "tiny", "--nodes", "2", "--steps", "2", "--run-dir", str(run_dir), *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and says in err, err
    assert not run_dir.exists(), "a refused run wrote its run dir"


def test_torchrun_rendezvous_endpoint_takes_a_list() -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic.coordinator.rendezvous import BACKEND, create_handler

    params = RendezvousParameters(backend=BACKEND, endpoint="10.0.0.1:2380,etcd-1", run_id="job", min_nodes=1,
                                  max_nodes=2, node_id="n0")
    handler = create_handler(params)  # no etcd call yet: gRPC channels connect lazily
    try:
        assert handler.etcd.endpoints == (("10.0.0.1", 2380), ("etcd-1", 2379))  # a member without a port: 2379
        assert sorted(handler.client.endpoints) == ["10.0.0.1:2380", "etcd-1:2379"]  # type: ignore[attr-defined]
    finally:
        handler.client.close()
