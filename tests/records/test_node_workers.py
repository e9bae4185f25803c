"""A node's registrations as one record (elastic/records/node_workers.py), against the workers' own.

The reference is what each worker registered: the node's record, folded in any order, and read
beside workers' own keys of the older form, gives back every worker's registration of the node's
latest incarnation, each once.
"""

from __future__ import annotations

import random
from functools import reduce

import pytest

from elastic.coordinator.jsonrecord import RecordError
from elastic.coordinator.keys import JobKeys, RunKeys
from elastic.records.node_workers import (
    NodeWorkers,
    node_workers_key,
    registration,
    registrations,
    worker_infos,
)
from elastic.records.workers import WorkerInfo

RK = RunKeys(JobKeys("j"))


def _info(node: int, local_rank: int, incarnation: int = 0) -> WorkerInfo:
    stamps = {"spawned": 1764426000.125 + node, "process": 1764426000.5 + node + local_rank / 100,
              "main": 1764426001.75 + local_rank / 10, "registered": 1764426002.0 + local_rank / 10}
    return WorkerInfo(pid=40_000 + 8 * node + local_rank, transfer_address=f"127.0.0.1:{30_000 + local_rank}",
                      incarnation=incarnation, started=stamps)


def _one(node: int, local_rank: int, incarnation: int = 0) -> NodeWorkers:
    return registration(RK, node, local_rank, _info(node, local_rank, incarnation), None)[1]


@pytest.mark.parametrize("seed", range(6))
def test_a_nodes_record_gives_back_every_registration_whatever_the_order(seed: int) -> None:
    rng = random.Random(seed)
    ones = [_one(5, lr) for lr in range(8)]
    ones += rng.sample(ones, 3)  # some folded twice (a relay's answer lost, the worker's own write)
    rng.shuffle(ones)
    record = reduce(NodeWorkers.fold, ones)
    assert record.workers == {lr: _info(5, lr) for lr in range(8)}
    assert NodeWorkers.from_json(record.to_packed()) == record


def test_a_later_incarnation_replaces_the_node_and_an_older_one_comes_too_late() -> None:
    old = reduce(NodeWorkers.fold, [_one(2, lr, 0) for lr in range(4)])
    restarted = old.fold(_one(2, 1, 1))
    assert restarted.workers == {1: _info(2, 1, 1)}, "the old incarnation's other workers are gone"
    assert restarted.fold(_one(2, 3, 0)) == restarted, "a registration of the old incarnation, late"
    assert _one(2, 3, 0).fold(restarted) == restarted, "the same, folded the other way round"
    with pytest.raises(ValueError, match="node 2's registrations cannot fold node 3's"):
        old.fold(_one(3, 0))


def test_registrations_read_both_forms_and_the_later_incarnation_wins() -> None:
    node_record = reduce(NodeWorkers.fold, [_one(1, lr, 2) for lr in range(3)])
    kvs = [(node_workers_key(RK, 1), node_record.to_packed()),
           (RK.worker(1, 0), _info(1, 0, 1).to_json().encode()),  # an older incarnation's own key
           (RK.worker(4, 2), _info(4, 2, 0).to_json().encode())]
    expected = {(1, lr): _info(1, lr, 2) for lr in range(3)} | {(4, 2): _info(4, 2, 0)}
    assert registrations(RK, kvs) == registrations(RK, reversed(kvs)) == expected
    assert worker_infos(node_record.to_packed()) == [_info(1, lr, 2) for lr in range(3)]
    assert worker_infos(_info(4, 2).to_json().encode()) == [_info(4, 2)]


def test_a_nodes_record_packs_to_a_fraction_of_its_text() -> None:
    record = reduce(NodeWorkers.fold, [_one(2047, lr) for lr in range(8)])
    text, packed = record.to_json(), record.to_packed()
    assert packed[0] == 0x78 and len(packed) * 2 < len(text), (len(text), len(packed))


def test_malformed_registrations_are_refused_naming_the_field() -> None:
    bad = NodeWorkers(node=1, workers={0: _info(1, 0)}).to_json().replace('"pid": 40008', '"pid": "x"')
    with pytest.raises(RecordError, match=r"NodeWorkers\.workers\['0'\]\.pid: expected int"):
        registrations(RK, [(node_workers_key(RK, 1), bad.encode())])
    with pytest.raises(ValueError, match="holds node 1's registrations"):
        registrations(RK, [(node_workers_key(RK, 2), _one(1, 0).to_packed())])
    with pytest.raises(RecordError, match="WorkerInfo"):
        worker_infos(b'{"node": 1}')
