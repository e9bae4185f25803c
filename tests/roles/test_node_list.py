"""A generation's reason names its nodes in a size that does not grow with the job."""

from __future__ import annotations

import random

from elastic.roles.leader_replan import NODE_LIST_MAX, node_list


def _expand(text: str) -> list[int]:
    """The nodes a `node_list` text names (the reference reading of it)."""
    body = text[1:text.index("]")]
    out: list[int] = []
    for part in body.split(", "):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


def test_a_short_list_is_spelled_out() -> None:
    nodes = [0, 1, 3, 4]
    assert node_list(nodes) == str(nodes)


def test_a_long_list_is_its_runs_and_says_every_node() -> None:
    rng = random.Random(3)
    for _ in range(50):
        nodes = sorted(rng.sample(range(4096), rng.randint(NODE_LIST_MAX + 1, 3000)))
        text = node_list(nodes)
        assert _expand(text) == nodes
        assert text.endswith(f"({len(nodes)} nodes)")


def test_2047_survivors_of_2048_take_a_few_characters() -> None:
    survivors = [n for n in range(2048) if n != 1272]
    assert node_list(survivors) == "[0-1271, 1273-2047] (2047 nodes)"
