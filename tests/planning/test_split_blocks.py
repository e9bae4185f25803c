"""split_blocks.py's array form of an even split against footprint's one-holder-at-a-time form."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.planning.footprint import GradShare
from elastic.planning.split_blocks import bit_length, even_split_blocks
from elastic.planning.sum_tree import disjoint_scratch, tree_levels


@settings(max_examples=200, deadline=None)
@given(microbatches=st.integers(1, 5000), pipelines=st.integers(1, 300))
def test_the_split_blocks_equal_every_holders_own(microbatches: int, pipelines: int) -> None:
    pipelines = min(pipelines, microbatches)
    split = [microbatches // pipelines + (1 if i < microbatches % pipelines else 0) for i in range(pipelines)]
    holders = GradShare.of_split(split).holders
    got = even_split_blocks(microbatches, pipelines)
    every = [b for own in holders for b in own]
    assert list(zip(got.starts.tolist(), got.sizes.tolist(), strict=True)) == every
    assert got.per_holder.tolist() == [len(own) for own in holders]
    assert got.levels.tolist() == [tree_levels(own) for own in holders]
    assert got.kinds() == sorted({(len(own), tree_levels(own)) for own in holders})
    assert got.scratch() == disjoint_scratch(tuple(every))


def test_bit_length_is_ints_own() -> None:
    values = [0, 1, 2, 3, 4, 7, 8, 2**20 - 1, 2**20, 2**52 - 1, 2**52]
    assert bit_length(np.array(values, dtype=np.int64)).tolist() == [v.bit_length() for v in values]
