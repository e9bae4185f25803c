"""Recovery over gRPC takes who holds which shard from etcd, not from the shard servers.

The holder map (`elastic.roles.holders`) is the `holdings/` keys joined with the `workers/`
records on real etcd; in a real recovery with every shard over gRPC (`shard_transport="grpc"`)
each fetching worker logs the map it read and what it fetched from whom: the map holds no key
of the lost node, every byte came from a holder of that map, those bytes are all the recovery
moved, and the run ends bit-identical to the failure-free one. The servers have no List method
at all (tests/transfer/test_fetch.py), so none can have been asked.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.coordinator import JobKeys
from elastic.coordinator.keys import RunKeys
from elastic.parallel.shard_moves import ranked_holdings
from elastic.records.summary import RunSummary
from elastic.records.workers import WorkerInfo
from elastic.roles.holders import HolderMap, holder_map_reader
from elastic.transfer.shards import ShardKey
from templates.plan import even_plan
from tests.faults.runs import check_same_training, max_rel_diff, reference_run, run_elastic

pytestmark = pytest.mark.timeout(200)

Reference = tuple[RunSummary, dict[str, torch.Tensor]]

_READ = re.compile(r"generation (\d+): fetching shards .* holder map read from etcd \(holdings/ \+ workers/\): (.*)$")
_FETCHED = re.compile(r"generation (\d+): fetched (\d+) shards over gRPC \((\d+) B\) from (\{.*\}) in ")
_HOLDER = re.compile(r"node(\d+)\.(\d+)@(\S+) ")


def _register(client: Any, rk: RunKeys, node: int, local_rank: int, address: str, lease: Any) -> None:
    info = WorkerInfo(pid=1000 + node, transfer_address=address, incarnation=0)
    client.put(rk.worker(node, local_rank), info.to_json(), lease=lease)


def test_the_holder_map_joins_holdings_with_workers(client: Any, job: str) -> None:
    rk = RunKeys(JobKeys(job))
    leases = {node: client.lease(30) for node in range(3)}
    for node in range(3):
        client.put(rk.worker_holdings(node, 0), json.dumps([[node, 0], [node + 3, 0]]), lease=leases[node])
    _register(client, rk, 0, 0, "10.0.0.1:7000", leases[0])
    _register(client, rk, 1, 0, "10.0.0.2:7000", leases[1])  # node 2 holds shards but has no registration
    known = HolderMap.read(client, rk)
    assert [(h.node, h.transfer_address) for h in known.holders] == [(0, "10.0.0.1:7000"), (1, "10.0.0.2:7000"), (2, None)]
    assert known.by_address(exclude="10.0.0.1:7000") == {"10.0.0.2:7000": [ShardKey(1, 0), ShardKey(4, 0)]}
    plan = even_plan(num_layers=6, nodes=[1, 2], num_pipelines=1, global_microbatches=2, microbatch_size=1,
                     fault_tolerance=0)
    by_worker = {(h.node, h.local_rank): h.shards for h in known.holders}
    assert ranked_holdings(plan, by_worker) == {0: [ShardKey(1, 0), ShardKey(4, 0)], 1: [ShardKey(2, 0), ShardKey(5, 0)]}

    # A lost node's keys go with its lease; a reader reads once, and its map is then fixed.
    reader = holder_map_reader(client, rk)
    assert reader() == known
    leases[1].revoke()
    assert reader() == known
    assert [h.node for h in HolderMap.read(client, rk).holders] == [0, 2]


def test_every_worker_reads_the_map_as_it_was_when_the_generation_was_published(client: Any, job: str) -> None:
    """A worker that has joined the new generation rewrites its holdings; a slower peer reading
    after it still gets the map of the publication revision (the same one every worker of the
    generation reads). Once etcd has compacted that revision, the map is read as it is now."""
    rk = RunKeys(JobKeys(job))
    lease = client.lease(30)
    _register(client, rk, 0, 0, "10.0.0.1:7000", lease)
    client.put(rk.worker_holdings(0, 0), json.dumps([[0, 0]]), lease=lease)
    published = client.put(rk.job.root + "plan-stand-in", "g").header.revision
    client.put(rk.worker_holdings(0, 0), json.dumps([[0, 0], [1, 0]]), lease=lease)  # joined: holds more
    _register(client, rk, 1, 0, "10.0.0.2:7000", lease)  # and a worker registered later
    at_publication = HolderMap.read(client, rk, revision=published)
    assert [(h.node, h.shards) for h in at_publication.holders] == [(0, (ShardKey(0, 0),))]
    assert holder_map_reader(client, rk, revision=published)() == at_publication
    now = HolderMap.read(client, rk)
    assert [(h.node, h.shards) for h in now.holders] == [(0, (ShardKey(0, 0), ShardKey(1, 0)))]
    client.compact(client.put(rk.job.root + "plan-stand-in", "g2").header.revision)
    assert HolderMap.read(client, rk, revision=published) == now


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return reference_run(tmp_path_factory, steps=20)


def _worker_lines(run_dir: Path) -> list[str]:
    return [line for log in sorted((run_dir / "logs").glob("node*.worker*.inc*.log"))
            for line in log.read_text(errors="replace").splitlines()]


@pytest.mark.slow
def test_recovery_over_grpc_fetches_from_the_holders_etcd_knows(reference: Reference, tmp_path: Path) -> None:
    summary, state = run_elastic(tmp_path, nodes=4, pipelines=2, inject=("kill:node=2,step=8",),
                                 shard_transport="grpc")
    check_same_training(summary, state, reference)
    assert max_rel_diff(state, reference[1]) == 0.0
    (rec,) = summary.recoveries
    assert rec["lost_nodes"] == [2] and rec["restore_checkpoint"] is None
    assert rec["bytes_moved"] > 0 and rec["bytes_moved_collective"] == 0, rec

    lines = _worker_lines(tmp_path)
    reads = [m for m in map(_READ.search, lines) if m]
    fetches = [m for m in map(_FETCHED.search, lines) if m]
    assert reads and len(fetches) == len(reads), "\n".join(lines)
    known: set[str] = set()
    for read in reads:
        holders = _HOLDER.findall(read.group(2))
        assert holders and all(int(node) != 2 for node, _, _ in holders), read.group(0)  # the lost node's keys are gone
        known |= {address for _, _, address in holders}
    moved = 0
    for fetch in fetches:
        by_holder: dict[str, int] = ast.literal_eval(fetch.group(4))
        assert set(by_holder) <= known, (by_holder, known)
        assert int(fetch.group(2)) > 0 and sum(by_holder.values()) == int(fetch.group(3))
        moved += int(fetch.group(3))
    assert moved == rec["bytes_moved"]  # every byte the recovery moved came from those holders
