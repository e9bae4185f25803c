"""Spreading shards over holders: balanced where holdings allow, constrained shards first."""

from __future__ import annotations

import pytest

from elastic.transfer.shards import ShardKey, assign_shards

pytestmark = pytest.mark.timeout(30)


def test_equal_holders_share_evenly() -> None:
    keys = [ShardKey(layer, tp) for layer in range(4) for tp in range(2)]
    plan = assign_shards({k: ["a", "b"] for k in keys})
    assert sorted(len(v) for v in plan.values()) == [4, 4]
    assert sorted(k for v in plan.values() for k in v) == keys


def test_constrained_shards_are_placed_first() -> None:
    # c0, c1 only on "a"; the flexible shards must then go to "b" to balance.
    candidates = {
        ShardKey(0, 0): ["a", "b"],
        ShardKey(1, 0): ["a", "b"],
        ShardKey(2, 0): ["a"],
        ShardKey(3, 0): ["a"],
    }
    plan = assign_shards(candidates)
    assert plan == {"a": [ShardKey(2, 0), ShardKey(3, 0)], "b": [ShardKey(0, 0), ShardKey(1, 0)]}


def test_deterministic_and_complete() -> None:
    candidates = {ShardKey(i, i % 3): ["x", "y", "z"][: 1 + i % 3] for i in range(10)}
    assert assign_shards(candidates) == assign_shards(dict(reversed(candidates.items())))
    plan = assign_shards(candidates)
    for holder, keys in plan.items():
        assert all(holder in candidates[k] for k in keys)
    assert sum(len(v) for v in plan.values()) == 10


def test_shard_without_candidate_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"no holder to fetch shards \[\(1, 0\)\]"):
        assign_shards({ShardKey(0, 0): ["a"], ShardKey(1, 0): []})
