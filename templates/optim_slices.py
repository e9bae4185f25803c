"""Who owns which slice of a layer's optimizer state when it is sharded (issue 55).

A layer is held by one node in each of the plan's P pipelines. Sharded, its AdamW state (per
tensor-parallel rank: every rank of a node owns the same slice of its own shard) is cut into
S = P // (f + 1) contiguous slices of the flattened layer, and each slice is owned by P // S or
P // S + 1 of the holders, never fewer than f + 1. The owners of one slice are in different
pipelines by construction, and in different failure domains (the hosts of `domains`) where the
holders allow it. Any f lost nodes leave every slice an owner; losing every owner of one slice
needs f + 1 nodes, which with full replicas (S = 1) would need all P.

After a re-plan `layer_owners(..., previous=...)` keeps each surviving holder on the slice that
overlaps most what it owned (the leader does so, and the generation record carries the result:
`owner_rows`, `owners_from_rows`), so `slice_moves` lists only the element ranges a new owner lacks,
each from a live old owner; `SliceLost` names a slice none of whose owners lived.

Pure: no torch, nothing of elastic; the planner's memory model, the simulator and the engine
share it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from templates.plan import Plan


class SliceLost(RuntimeError):
    """Every owner of a slice of a layer's optimizer state was lost: only a checkpoint has it."""

    def __init__(self, layer: int, index: int, slices: int, owners: Sequence[int]) -> None:
        super().__init__(f"layer {layer}, optimizer slice {index + 1} of {slices}: every owner lost "
                         f"(nodes {', '.join(map(str, owners))})")
        self.layer, self.index, self.slices, self.owners = layer, index, slices, tuple(owners)


@dataclass(frozen=True, kw_only=True)
class SliceOwnership:
    """One layer's slices: `owners[j]`, the nodes owning slice j (sorted)."""

    layer: int
    owners: tuple[tuple[int, ...], ...]

    @property
    def slices(self) -> int:
        return len(self.owners)

    def slice_of(self, node: int) -> int | None:
        """The slice `node` owns, None when it owns none (it does not hold the layer)."""
        return next((j for j, nodes in enumerate(self.owners) if node in nodes), None)

    def bounds(self, index: int, sizes: Sequence[int]) -> tuple[int, int]:
        """Elements [start, stop) of slice `index` of the flattened layer whose parameters (in
        canonical order) have `sizes` elements (`aligned_cuts`)."""
        cuts = aligned_cuts(sizes, self.slices)
        return cuts[index], cuts[index + 1]


@dataclass(frozen=True, kw_only=True)
class SliceMove:
    """Elements [start, stop) of `layer`'s flattened optimizer state that `node` lacks, from `source`."""

    layer: int
    node: int
    start: int
    stop: int
    source: int


def slice_count(holders: int, fault_tolerance: int) -> int:
    """S = holders // (f + 1), at least 1 (fewer than f + 1 holders: one slice, owned by all)."""
    if holders < 1 or fault_tolerance < 0:
        raise ValueError(f"need holders >= 1 and f >= 0, got {holders} and {fault_tolerance}")
    return max(1, holders // (fault_tolerance + 1))


ALIGN = 64
"""Slice cuts fall on multiples of 64 elements of the parameter they cut. torch's fused AdamW
kernel on CPU computes a tensor's vectorised body and its tail with different roundings: on this
project's AVX2 machine, updating a tensor in pieces cut at multiples of 4 elements changed
bits, at multiples of 8 it did not. An element must sit at the same place of the kernel's
vectors whoever updates it (an owner of its slice, or a holder of the whole layer) for every
plan to stay bit-identical; 64 covers AVX-512's 16 lanes with room for unrolling."""


def aligned_cuts(sizes: Sequence[int], slices: int, *, align: int = ALIGN) -> list[int]:
    """The slices + 1 cut points of a flattened layer whose parameters have `sizes` elements:
    slice j is [cuts[j], cuts[j + 1]). Each even split point moves down to the nearest multiple
    of `align` counted from the start of the parameter it falls in (a slice may be empty)."""
    if slices < 1 or align < 1 or any(n < 0 for n in sizes):
        raise ValueError(f"need slices >= 1, align >= 1 and sizes >= 0, got {slices}, {align}, {list(sizes)}")
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    numel = starts[-1]
    cuts = [0]
    for j in range(1, slices):
        point = j * numel // slices
        first = max(i for i in range(len(sizes)) if starts[i] <= point) if sizes else 0
        cuts.append(max(cuts[-1], starts[first] + (point - starts[first]) // align * align))
    return [*cuts, numel]


def slice_bounds(numel: int, slices: int, index: int) -> tuple[int, int]:
    """Elements [start, stop) of slice `index` of `slices` even contiguous slices of `numel`."""
    if not 0 <= index < slices:
        raise ValueError(f"slice {index} of {slices}")
    return index * numel // slices, (index + 1) * numel // slices


def layer_holders(plan: Plan, layer: int) -> list[int]:
    """The node holding `layer` in each pipeline, in pipeline order."""
    holders = [st.node for pipe in plan.pipelines for st in pipe.stages if st.holds(layer)]
    if not holders:
        raise ValueError(f"no stage of the plan holds layer {layer}")
    return holders


def layer_owners(plan: Plan, layer: int, *, domains: Mapping[int, str] | None = None,
                 previous: SliceOwnership | None = None) -> SliceOwnership:
    """The slices of `layer` under `plan` and their owners (see the module's docs); with
    `previous` (the layer's ownership before a re-plan), each surviving holder keeps the slice
    that overlaps most what it owned. O(P x S) for P holders and S slices."""
    return owners_among(layer_holders(plan, layer), layer=layer, fault_tolerance=plan.fault_tolerance,
                        domains=domains, previous=previous)


def owners_among(holders: Sequence[int], *, layer: int, fault_tolerance: int,
                 domains: Mapping[int, str] | None = None,
                 previous: SliceOwnership | None = None) -> SliceOwnership:
    """`layer_owners` for a layer whose holders (one a pipeline, in pipeline order) are known."""
    slices = slice_count(len(holders), fault_tolerance)
    given = domains or {}
    if previous is None and len({given.get(n, f"node{n}") for n in holders}) == len(holders):
        # every holder a domain of its own, nothing to keep: the greedy fill below is round robin
        order = [n for _, _, n in sorted((given.get(n, ""), i, n) for i, n in enumerate(holders))]
        return SliceOwnership(layer=layer, owners=tuple(tuple(sorted(order[j::slices])) for j in range(slices)))
    fill = _Filler(holders=len(holders), slices=slices)
    domain = {n: given.get(n, f"node{n}") for n in holders}
    had = {n: j for j, nodes in enumerate(previous.owners) for n in nodes} if previous is not None else {}
    for node in (n for n in holders if n in had):
        assert previous is not None
        fill.add(node, domain[node], _overlaps(previous, had[node], fill.slices))
    rest = sorted((given.get(n, ""), i, n) for i, n in enumerate(holders) if n not in had)
    for _, _, node in rest:
        fill.add(node, domain[node], {})
    return SliceOwnership(layer=layer, owners=tuple(tuple(sorted(o)) for o in fill.owners))


class _Filler:
    """Slices filled one owner at a time: each gets P // S owners, P % S of them one more."""

    def __init__(self, *, holders: int, slices: int) -> None:
        self.slices = slices
        self.base, self.extra = divmod(holders, slices)
        self.owners: list[list[int]] = [[] for _ in range(slices)]
        self.domains: list[dict[str, int]] = [{} for _ in range(slices)]
        self.full = 0  # slices with base + 1 owners

    def room(self, j: int) -> bool:
        size = len(self.owners[j])
        return size < self.base or (size == self.base and self.full < self.extra)

    def add(self, node: int, domain: str, first: Mapping[int, int]) -> None:
        """Give `node` the slice with room that has the most `first[j]` (0 where absent), then
        the fewest owners of its domain, the fewest owners, the lowest j."""
        j = min((j for j in range(self.slices) if self.room(j)),
                key=lambda j: (-first.get(j, 0), self.domains[j].get(domain, 0), len(self.owners[j]), j))
        self.full += len(self.owners[j]) == self.base
        self.owners[j].append(node)
        self.domains[j][domain] = self.domains[j].get(domain, 0) + 1


def _overlaps(previous: SliceOwnership, had: int, slices: int) -> dict[int, int]:
    """Slice j of `slices` -> how much of slice `had` of `previous` it covers (in 2**40ths of
    the layer), for the j that cover any."""
    whole = 1 << 40
    lo, hi = slice_bounds(whole, previous.slices, had)
    out: dict[int, int] = {}
    for j in range(lo * slices // whole, min(slices, hi * slices // whole + 1)):
        start, stop = slice_bounds(whole, slices, j)
        if min(hi, stop) > max(lo, start):
            out[j] = min(hi, stop) - max(lo, start)
    return out


def plan_owners(plan: Plan, *, domains: Mapping[int, str] | None = None,
                previous: Mapping[int, SliceOwnership] | None = None) -> dict[int, SliceOwnership]:
    """`layer_owners` of every layer of the plan, by layer."""
    prev = previous or {}
    out: dict[int, SliceOwnership] = {}
    done: dict[tuple[tuple[int, ...], SliceOwnership | None], SliceOwnership] = {}
    for layer in range(plan.num_layers):  # layers with the same holders and history: the same owners
        key = (tuple(layer_holders(plan, layer)), _unlabelled(prev.get(layer)))
        if key not in done:
            done[key] = layer_owners(plan, layer, domains=domains, previous=prev.get(layer))
        out[layer] = SliceOwnership(layer=layer, owners=done[key].owners)
    return out


OwnerRows = list[list[list[int]]]
"""Every layer's owners as a record stores them: `rows[layer][j]`, the nodes owning slice j."""


def owner_rows(owned: Mapping[int, SliceOwnership]) -> OwnerRows:
    """`owned` (every layer's ownership, by layer) as rows (`OwnerRows`)."""
    return [[list(nodes) for nodes in owned[layer].owners] for layer in sorted(owned)]


def owners_from_rows(plan: Plan, rows: Sequence[Sequence[Sequence[int]]]) -> dict[int, SliceOwnership]:
    """The ownership `rows` states for `plan`, by layer; ValueError naming the layer when it is not
    an ownership of the plan: for each layer, `slice_count` slices whose owners are the layer's
    holders, each holder once, at least f + 1 owners a slice (all holders when fewer)."""
    if len(rows) != plan.num_layers:
        raise ValueError(f"slice owners name {len(rows)} layers, the plan has {plan.num_layers}")
    out: dict[int, SliceOwnership] = {}
    for layer, slices in enumerate(rows):
        holders = sorted(layer_holders(plan, layer))
        want = slice_count(len(holders), plan.fault_tolerance)
        least = min(plan.fault_tolerance + 1, len(holders))
        if (len(slices) != want or sorted(n for nodes in slices for n in nodes) != holders
                or any(len(nodes) < least for nodes in slices)):
            raise ValueError(f"layer {layer}: slice owners {[list(nodes) for nodes in slices]} are not {want} "
                             f"slices of at least {least} of its holders {holders}, each holder once")
        out[layer] = SliceOwnership(layer=layer, owners=tuple(tuple(sorted(nodes)) for nodes in slices))
    return out


def _unlabelled(own: SliceOwnership | None) -> SliceOwnership | None:
    return None if own is None else SliceOwnership(layer=-1, owners=own.owners)


def lost_slices(owned: Mapping[int, SliceOwnership], lost: Collection[int]) -> list[SliceLost]:
    """The slices every owner of which is in `lost`."""
    dead = set(lost)
    return [SliceLost(o.layer, j, o.slices, nodes) for o in owned.values()
            for j, nodes in enumerate(o.owners) if set(nodes) <= dead]


def slice_moves(old: SliceOwnership, new: SliceOwnership, *, sizes: Sequence[int],
                live: Collection[int], sent: dict[int, int] | None = None) -> list[SliceMove]:
    """The element ranges each owner under `new` lacks (what it owned under `old` it keeps),
    cut at `old`'s slice bounds, each from the live old owner that has sent the fewest elements
    so far (`sent`, updated: pass one dict for every layer of a change; ties: the
    lowest-numbered). Raises SliceLost for a needed range no live node owned. O(P log S + moves)."""
    alive = set(live)
    old_cuts, new_cuts = aligned_cuts(sizes, old.slices), aligned_cuts(sizes, new.slices)
    had = {n: i for i, nodes in enumerate(old.owners) for n in nodes}
    sent = {} if sent is None else sent
    moves: list[SliceMove] = []
    for j, nodes in enumerate(new.owners):
        start, stop = new_cuts[j], new_cuts[j + 1]
        for node in nodes:
            for i in range(max(0, bisect_right(old_cuts, start) - 1), old.slices):
                lo, hi = max(old_cuts[i], start), min(old_cuts[i + 1], stop)
                if old_cuts[i] >= stop:
                    break
                if lo >= hi or had.get(node) == i:
                    continue
                sources = alive.intersection(old.owners[i])
                if not sources:
                    raise SliceLost(old.layer, i, old.slices, old.owners[i])
                source = min(sources, key=lambda n: (sent.get(n, 0), n))
                sent[source] = sent.get(source, 0) + hi - lo
                moves.append(SliceMove(layer=new.layer, node=node, start=lo, stop=hi, source=source))
    return moves


def plan_slice_moves(old: Plan, new: Plan, *, lost: Collection[int], sizes: Mapping[int, Sequence[int]],
                     domains: Mapping[int, str] | None = None,
                     previous: Mapping[int, SliceOwnership] | None = None,
                     ) -> tuple[dict[int, SliceOwnership], list[SliceMove]]:
    """A generation change's optimizer-state part: the new plan's owners (kept close to the old
    ones: `previous`, default the old plan's own) and the moves that give every new owner its
    slice, from old owners that are not in `lost`. Raises SliceLost, naming the slice, when
    every owner of one was lost: only a checkpoint has it. `sizes[layer]`: the element counts of
    the layer's parameters, canonical order."""
    before = dict(previous) if previous is not None else plan_owners(old, domains=domains)
    dead = set(lost)
    gone = lost_slices(before, dead)
    if gone:
        raise gone[0]
    after = plan_owners(new, domains=domains, previous=before)
    live, sent = set(old.nodes) - dead, dict[int, int]()
    moves = [m for layer in range(new.num_layers)
             for m in slice_moves(before[layer], after[layer], sizes=sizes[layer], live=live, sent=sent)]
    return after, moves
