"""The step's summation tree: aligned blocks of any microbatch set, combined in tree order, and
the accumulator's per-block sums built as gradients arrive. Every split of the microbatches
into blocks gives the bits of one reference: a plain recursive pairwise sum over the leaves."""

from __future__ import annotations

import pytest
import torch

from elastic.parallel import bucket_reducer, grad_sync
from elastic.parallel.blocks import Block, CombineProgram, combine, decompose
from elastic.parallel.exchange import SUM_CHUNK
from elastic.parallel.grad_accum import GradAccumulator

pytestmark = pytest.mark.timeout(60)


def _pairwise(leaves: dict[int, torch.Tensor], start: int, size: int) -> torch.Tensor | None:
    """The reference: the tree's sum of the present leaves in [start, start + size)."""
    if size == 1:
        return leaves.get(start)
    half = size // 2
    left, right = _pairwise(leaves, start, half), _pairwise(leaves, start + half, half)
    if left is None or right is None:
        return left if right is None else right
    return left + right


def _reference(leaves: dict[int, torch.Tensor]) -> torch.Tensor:
    top = 1
    while top < max(leaves) + 1:
        top *= 2
    out = _pairwise(leaves, 0, top)
    assert out is not None
    return out


def _leaves(count: int, n: int = 3000, seed: int = 0) -> dict[int, torch.Tensor]:
    """Leaves of widely spread magnitudes, so that any other association changes bits."""
    gen = torch.Generator().manual_seed(seed)
    return {i: torch.randn(n, generator=gen) * 10.0 ** torch.randint(-6, 2, (n,), generator=gen).float()
            for i in range(count)}


def test_decompose_gives_the_fewest_aligned_blocks_of_any_set() -> None:
    assert decompose(range(8)) == (Block(0, 8),)
    assert decompose(range(3, 6)) == (Block(3, 1), Block(4, 2))
    assert decompose([0, 1, 2, 6]) == (Block(0, 2), Block(2, 1), Block(6, 1))
    assert decompose(range(6)) == (Block(0, 4), Block(4, 2))
    assert decompose([]) == ()
    for start in range(20):
        for end in range(start, 40):
            blocks = decompose(range(start, end))
            assert [m for b in blocks for m in range(b.start, b.end)] == list(range(start, end))
            assert all(b.size & (b.size - 1) == 0 and b.start % b.size == 0 for b in blocks)
            # Fewest: no two neighbours are buddies that would merge into an aligned block.
            assert not any(a.size == b.size and a.end == b.start and a.start % (2 * a.size) == 0
                           for a, b in zip(blocks, blocks[1:], strict=False))
    with pytest.raises(ValueError, match=">= 0"):
        decompose([-1, 0])


@pytest.mark.parametrize("total", [1, 2, 3, 5, 8, 11, 16])
def test_every_split_into_blocks_combines_to_the_reference_bits(total: int) -> None:
    leaves = _leaves(total, seed=total)
    expected = _reference(leaves)
    sequential = leaves[0].clone()
    for i in range(1, total):
        sequential += leaves[i]
    if total >= 5:
        assert not torch.equal(sequential, expected), "the leaves must tell associations apart"
    splits = [[range(total)], [range(0, 1), range(1, total)], [range(i, i + 1) for i in range(total)],
              [range(0, total // 3), range(total // 3, total)], [range(0, total - 1), range(total - 1, total)]]
    for split in splits:
        blocks = [b for part in split for b in decompose(part)]
        parts = [_reference({m: leaves[m] for m in range(b.start, b.end)}) for b in blocks]
        program = CombineProgram(blocks)
        out = torch.full_like(expected, float("nan"))
        scratch = [torch.empty(700) for _ in range(program.scratch)]  # chunks not dividing the length
        norm, wide = torch.zeros((), dtype=torch.float64), torch.empty(700, dtype=torch.float64)
        combine(blocks, parts, out, scratch, program=program, norm=norm, wide=wide)
        assert torch.equal(out, expected), [list(p) for p in split]
        assert norm.item() == pytest.approx(expected.double().square().sum().item(), rel=1e-12)


def test_zero_filled_repeats_of_a_block_change_no_bit() -> None:
    """A replayed step: two workers send block (0, 2), each with sums for half the elements and
    zeros elsewhere; (2, 1) and (3, 1) come from a third."""
    leaves = _leaves(4, seed=9)
    expected = _reference(leaves)
    first = _reference({0: leaves[0], 1: leaves[1]})
    a, b = first.clone(), first.clone()
    a[1500:] = 0
    b[:1500] = 0
    blocks = [Block(2, 1), Block(0, 2), Block(3, 1), Block(0, 2)]
    parts = [leaves[2], a, leaves[3], b]
    out = torch.empty_like(expected)
    program = CombineProgram(blocks)
    combine(blocks, parts, out, [torch.empty(3000) for _ in range(program.scratch)], program=program)
    assert torch.equal(out, expected)


def _accumulate(blocks: list[Block], leaves: dict[int, torch.Tensor], skip: set[int] = frozenset(),
                dtype: torch.dtype = torch.float32) -> dict[Block, torch.Tensor]:
    """Each leaf's gradient arrives through autograd into a parameter (none in `skip`)."""
    n = next(iter(leaves.values())).numel()
    weight = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
    other = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
    module = torch.nn.ParameterDict({"w": weight, "o": other})
    acc = GradAccumulator(module, dtype=torch.float32)
    acc.begin(blocks)
    for b in sorted(blocks):
        for m in range(b.start, b.end):
            acc.leaf(m)
            used = weight if m not in skip else weight.detach()  # no gradient reaches w
            loss = (used * leaves[m].to(dtype)).sum() + other.sum()
            loss.backward()
    return {b: named["w"].clone() for b, named in acc.block_sums().items()}


@pytest.mark.parametrize("size", [1, 2, 4, 8, 16])
def test_the_accumulator_sums_a_block_in_tree_order(size: int) -> None:
    leaves = _leaves(2 * size, seed=size)
    sums = _accumulate([Block(size, size)], leaves)
    assert torch.equal(sums[Block(size, size)], _reference({m - size: leaves[m] for m in range(size, 2 * size)}))


def test_several_blocks_and_leaves_without_a_gradient() -> None:
    """Blocks (3, 1), (4, 4), (8, 2); w gets no gradient in microbatches 5 and 9 (the tail of a
    block: completed when read): they count as zeros."""
    leaves = _leaves(10, seed=4)
    blocks = [Block(3, 1), Block(4, 4), Block(8, 2)]
    sums = _accumulate(blocks, leaves, skip={5, 9})
    zeros = torch.zeros_like(leaves[0])
    for b in blocks:
        expected = _reference({m - b.start: zeros if m in {5, 9} else leaves[m] for m in range(b.start, b.end)})
        assert torch.equal(sums[b], expected), b


def test_narrower_gradients_are_widened_before_they_are_added() -> None:
    leaves = {m: t.to(torch.bfloat16) for m, t in _leaves(4, seed=5).items()}
    sums = _accumulate([Block(0, 4)], {m: t.float() for m, t in leaves.items()}, dtype=torch.bfloat16)
    assert torch.equal(sums[Block(0, 4)], _reference({m: t.float() for m, t in leaves.items()}))


def test_bad_blocks_and_leaves_are_refused() -> None:
    acc = GradAccumulator(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="aligned"):
        acc.begin([Block(1, 2)])
    with pytest.raises(ValueError, match="overlap"):
        acc.begin([Block(0, 2), Block(1, 1)])
    acc.begin([Block(0, 2)])
    with pytest.raises(ValueError, match="microbatch 2 is in none"):
        acc.leaf(2)
    with pytest.raises(ValueError, match="not a block of this step"):
        acc.add(Block(2, 2), {})


def test_the_accelerator_way_combines_in_one_pass_to_the_same_bits() -> None:
    """On an accelerator the combine runs over the whole slice at once and measures it with one
    float64 norm kernel (`wide=None`); on CPU in cache-sized chunks through a float64 buffer. Same
    sums, bit for bit; the same sum of squares to rounding."""
    gen = torch.Generator().manual_seed(5)
    blocks = [Block(0, 2), Block(2, 1), Block(3, 1)]
    parts = [torch.randn(10_001, generator=gen) * 10.0 ** torch.randint(-4, 3, (10_001,), generator=gen).float()
             for _ in blocks]
    program = CombineProgram(blocks)
    chunked, whole = torch.empty(10_001), torch.empty(10_001)
    norms = [torch.zeros((), dtype=torch.float64) for _ in range(2)]
    combine(blocks, parts, chunked, [torch.empty(777) for _ in range(program.scratch)], program=program,
            norm=norms[0], wide=torch.empty(777, dtype=torch.float64))
    combine(blocks, parts, whole, [torch.empty(10_001) for _ in range(program.scratch)], program=program,
            norm=norms[1], wide=None)
    assert torch.equal(chunked, whole)
    assert norms[1].item() == pytest.approx(norms[0].item(), rel=1e-12)
    assert norms[0].item() == pytest.approx(whole.double().square().sum().item(), rel=1e-12)
    assert bucket_reducer._chunk(1 << 20, torch.device("cpu")) == SUM_CHUNK
    assert bucket_reducer._chunk(1 << 20, torch.device("cuda", 0)) == 1 << 20
    t = parts[0]
    assert grad_sync.sum_of_squares(t, None).item() == pytest.approx(
        grad_sync.sum_of_squares(t, torch.empty(1000, dtype=torch.float64)).item(), rel=1e-12)
