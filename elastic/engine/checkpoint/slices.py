"""A shard written in slices (issue 55): with the optimizer sharded, each slice of a layer's state is
written once, by one of its owners, and no holder gathers what it does not own.

    layer-<LLLL>-tp-<TT>.<token>/ and .done              the head: the shard's AdamW step count;
                                                         its marker has the parameters' shapes
                                                         and the slice count S (marker version 3)
    layer-<LLLL>-tp-<TT>-slice-<J>-of-<S>.<token>/ .done slice J: elements [a, b) of each
                                                         parameter it spans, flattened
                                                         (`param/`, `exp_avg/`, `exp_avg_sq/`);
                                                         its marker has each parameter's a

The owners of a slice hold its parameters and moments as of the last commit (they updated them);
every other holder's copy of those parameters is one update behind until the next step's gather.
So a slice's owner writes it without asking anyone, as a whole shard's writer does: a checkpoint
is no collective and never waits on a peer. A shard counts as committed when its head and its S
slices are (`files.missing_shards`). Readers `assemble` the whole shard first, so everything
after the load (resume at any layout, sharded or not, the fallback, resharding, export) reads it
as a shard written whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from elastic.engine.checkpoint.files import CheckpointError
from elastic.transfer.shards import ShardKey

KINDS = ("param", "exp_avg", "exp_avg_sq")
"""The per-parameter tensors of a shard (`Trainer.export_shard`): the parameter and its AdamW moments."""


@dataclass(frozen=True, kw_only=True)
class SliceInfo:
    """What a head's or a slice's marker says beyond a whole shard's (files.ShardMarker)."""

    slices: int
    """The number of slices the shard is written in."""
    index: int | None = None
    """A slice: its number; None: the head."""
    shapes: dict[str, list[int]] | None = None
    """The head: each parameter's shape, by canonical name."""
    offsets: dict[str, int] | None = None
    """A slice: each parameter's first element in it (flattened)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointPart:
    """One data directory and marker of a checkpoint step: a whole shard (`sliced` None), or a
    head or slice of a shard written sliced."""

    key: ShardKey
    tensors: dict[str, torch.Tensor]
    sliced: SliceInfo | None = None


def head_part(key: ShardKey, *, step: int, shapes: Mapping[str, Sequence[int]], slices: int) -> CheckpointPart:
    """The head of a shard written in `slices` slices: its AdamW step count and parameters' shapes."""
    if slices < 1:
        raise ValueError(f"shard {tuple(key)}: a sliced shard needs >= 1 slice, got {slices}")
    return CheckpointPart(key=key, tensors={"step": torch.tensor(step, dtype=torch.int64)},
                sliced=SliceInfo(slices=slices, shapes={n: list(s) for n, s in shapes.items()}))


def slice_part(key: ShardKey, *, index: int, slices: int, pieces: Mapping[str, tuple[int, Sequence[torch.Tensor]]]) -> CheckpointPart:
    """Slice `index` of `slices` of a shard: `pieces` maps each parameter it spans to (its first
    element, its (param, exp_avg, exp_avg_sq) elements, flattened and of one length)."""
    if not 0 <= index < slices:
        raise ValueError(f"shard {tuple(key)}: slice {index} of {slices}")
    tensors: dict[str, torch.Tensor] = {}
    for name, (_, parts) in pieces.items():
        if len(parts) != len(KINDS) or len({t.numel() for t in parts}) != 1:
            raise ValueError(f"shard {tuple(key)} slice {index}: {name} needs {len(KINDS)} pieces of one length")
        tensors.update({f"{kind}/{name}": t.reshape(-1) for kind, t in zip(KINDS, parts, strict=True)})
    return CheckpointPart(key=key, tensors=tensors,
                sliced=SliceInfo(slices=slices, index=index, offsets={n: a for n, (a, _) in pieces.items()}))


def assemble(where: str, *, step: torch.Tensor, shapes: Mapping[str, Sequence[int]],
             slices: Sequence[tuple[Mapping[str, int], Mapping[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """The whole shard (`param/`, `exp_avg/`, `exp_avg_sq/` of each parameter of `shapes`, and
    `step`) from its head's step count and shapes and its slices' (offsets, tensors).
    CheckpointError naming `where` unless every element of every tensor comes from exactly one
    slice, with nothing left over."""
    cover: dict[str, list[tuple[int, int]]] = {n: [] for n in shapes}
    for i, (offsets, _) in enumerate(slices):
        for name, a in offsets.items():
            if name not in cover:
                raise CheckpointError(f"{where}: slice {i} holds {name}, which the head does not name")
            cover[name].append((a, i))
    out: dict[str, torch.Tensor] = {"step": step.clone()}
    for name, shape in shapes.items():
        numel = 1
        for d in shape:
            numel *= d
        at = 0
        flat: dict[str, torch.Tensor] = {}
        for a, i in sorted(cover[name]):
            tensors = slices[i][1]
            got = [tensors.get(f"{kind}/{name}") for kind in KINDS]
            if any(t is None for t in got) or len({t.numel() for t in got if t is not None}) != 1:
                raise CheckpointError(f"{where}: slice {i} lacks one of {name}'s tensors or has them of other lengths")
            length = got[0].numel()  # type: ignore[union-attr]
            if a != at or a + length > numel:
                raise CheckpointError(f"{where}: {name}'s elements [{a}, {a + length}) do not follow [0, {at}) "
                                      f"within its {numel}: the slices overlap, leave a gap or overrun")
            for kind, t in zip(KINDS, got, strict=True):
                assert t is not None
                if kind not in flat:
                    flat[kind] = torch.empty(numel, dtype=t.dtype)
                flat[kind][a:a + length].copy_(t.reshape(-1))
            at += length
        if at != numel:
            raise CheckpointError(f"{where}: {name} has {at} of its {numel} elements in the slices")
        out.update({f"{kind}/{name}": flat[kind].view(*shape) for kind in KINDS})
    return out


def assemble_parts(parts: Sequence[CheckpointPart]) -> dict[ShardKey, dict[str, torch.Tensor]]:
    """Whole shards from the parts of one step (every worker's): whole shards as they are, and
    each head with its slices `assemble`d. ValueError when a head's slice count disagrees with its
    slices, or a slice is written twice or missing."""
    out = {p.key: p.tensors for p in parts if p.sliced is None}
    heads = {p.key: p for p in parts if p.sliced is not None and p.sliced.index is None}
    pieces: dict[ShardKey, dict[int, CheckpointPart]] = {}
    for p in parts:
        if p.sliced is not None and p.sliced.index is not None:
            if p.sliced.index in pieces.setdefault(p.key, {}):
                raise ValueError(f"shard {tuple(p.key)}: slice {p.sliced.index} written twice")
            pieces[p.key][p.sliced.index] = p
    for key, head in heads.items():
        assert head.sliced is not None and head.sliced.shapes is not None
        got = pieces.get(key, {})
        if sorted(got) != list(range(head.sliced.slices)) or any(
                p.sliced is not None and p.sliced.slices != head.sliced.slices for p in got.values()):
            raise ValueError(f"shard {tuple(key)}: slices {sorted(got)} for a head of {head.sliced.slices}")
        out[key] = assemble(f"shard {tuple(key)}", step=head.tensors["step"], shapes=head.sliced.shapes,
                            slices=[(p.sliced.offsets or {}, p.tensors) for p in (got[j] for j in sorted(got))
                                    if p.sliced is not None])
    return out
