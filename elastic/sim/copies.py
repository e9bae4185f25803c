"""How close a run came to losing every copy of some optimizer state (issue 55).

A failure leaves the layers its node held with one copy fewer until the re-plan's transfers
have put the new holders' copies in place (`until`). A second failure inside that window that
takes the last live copy is a checkpoint fallback. The run is watched two ways at once:

- full replicas (today): a layer is lost when every holder of it in the last plan whose copies
  were in place is lost;
- sharded optimizer state (`templates/optim_slices.py`, f + 1 owners of each slice): a slice
  is lost when every one of its owners is.

Besides the losses that happen, each window's *exposure* is counted: node-seconds during which
one more failure of a given node would have lost a copy (the live nodes that hold the last copy
of something, times the window). Exposure times the trace's per-node failure rate is the
expected number of losses, which states the trade even when a trace of independent failures
shows none. Only the first-order term (one more failure) is counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from templates.optim_slices import SliceOwnership, owners_among
from templates.plan import PipelinePlan, Plan


@dataclass(kw_only=True)
class CopyLosses:
    """The counts a run reports, full replicas beside sharded slices."""

    layers_lost: int = 0
    """Failures that took the last copy of some layer (full replicas)."""
    slices_lost: int = 0
    """Failures that took the last owner of some optimizer slice (sharded)."""
    layer_exposure_node_s: float = 0.0
    """Node-seconds in which one more failure would have lost a layer (full replicas)."""
    slice_exposure_node_s: float = 0.0
    """The same for a slice (sharded)."""

    def to_dict(self) -> dict[str, float]:
        return {"layers_lost": self.layers_lost, "slices_lost": self.slices_lost,
                "layer_exposure_node_s": self.layer_exposure_node_s,
                "slice_exposure_node_s": self.slice_exposure_node_s}


@dataclass(kw_only=True)
class CopyWatch:
    """The window after each failure: the plan whose copies were in place, the nodes lost since."""

    counts: CopyLosses = field(default_factory=CopyLosses)
    plan: Plan | None = None
    lost: set[int] = field(default_factory=set)
    until: float = 0.0
    """When the copies of the last re-plan are in place."""
    _last: tuple[float, int, int] | None = field(default=None, init=False)
    """The last failure's (time, nodes holding a last layer copy, nodes owning a last slice)."""
    _tables: _Tables = field(default_factory=lambda: _Tables(), init=False)

    def failure(self, plan: Plan, node: int, t: float) -> None:
        """`node` of `plan` (the plan that runs) fails at `t`. Within the last failure's
        window the plan whose copies were in place stays the reference and the lost add up."""
        if self.plan is None or t >= self.until:
            self.plan, self.lost = plan, set()
        self.lost.add(node)
        layers, slices = self._last_copies()
        self.counts.layers_lost += any(not holders for holders in layers.values())
        self.counts.slices_lost += any(not owners for owners in slices.values())
        self._last = (t, _single(layers), _single(slices))

    def protected(self, t: float) -> None:
        """The re-plan after the last failure has its copies in place at `t` (a join's re-plan
        is no failure's: it neither opens nor ends a window)."""
        self.until = t
        if self._last is not None:
            start, layer_nodes, slice_nodes = self._last
            self.counts.layer_exposure_node_s += layer_nodes * (t - start)
            self.counts.slice_exposure_node_s += slice_nodes * (t - start)
            self._last = None

    def _last_copies(self) -> tuple[dict[int, set[int]], dict[tuple[int, int], set[int]]]:
        """For each layer a lost node held: its live holders; for each slice a lost node owned:
        its live owners (both under the plan whose copies were in place). A re-plan of 2,048
        nodes must not pay for every layer's holders: each pipeline's layer -> node table and
        each holder set's owners are kept across failures (the planner reuses pipelines)."""
        assert self.plan is not None
        plan, lost = self.plan, self.lost
        tables = [self._tables.table(pipe) for pipe in plan.pipelines]
        hit = sorted({layer for held, _ in tables for n in lost for layer in held.get(n, ())})
        holders = {layer: tuple(nodes[layer] for _, nodes in tables) for layer in hit}
        layers = {layer: set(nodes) - lost for layer, nodes in holders.items()}
        slices: dict[tuple[int, int], set[int]] = {}
        for layer, nodes in holders.items():
            own, index = self._tables.owners(nodes, plan.fault_tolerance)
            for j in {index[n] for n in lost.intersection(nodes)}:
                slices[(layer, j)] = set(own.owners[j]) - lost
        return layers, slices


class _Tables:
    """Per pipeline (by identity): node -> the layers it holds, and layer -> its node; per holder
    set: its slices' owners and node -> slice. Bounded: cleared past `LIMIT` entries."""

    LIMIT = 65536

    def __init__(self) -> None:
        self._pipes: dict[int, tuple[PipelinePlan, dict[int, tuple[int, ...]], tuple[int, ...]]] = {}
        self._owners: dict[tuple[tuple[int, ...], int], tuple[SliceOwnership, dict[int, int]]] = {}

    def table(self, pipe: PipelinePlan) -> tuple[dict[int, tuple[int, ...]], tuple[int, ...]]:
        got = self._pipes.get(id(pipe))
        if got is None or got[0] is not pipe:
            if len(self._pipes) > self.LIMIT:
                self._pipes.clear()
            held = {st.node: st.held for st in pipe.stages}
            nodes = [0] * (max(layer for layers in held.values() for layer in layers) + 1)
            for node, layers in held.items():
                for layer in layers:
                    nodes[layer] = node
            got = self._pipes[id(pipe)] = (pipe, held, tuple(nodes))
        return got[1], got[2]

    def owners(self, holders: tuple[int, ...], fault_tolerance: int) -> tuple[SliceOwnership, dict[int, int]]:
        key = (holders, fault_tolerance)
        got = self._owners.get(key)
        if got is None:
            if len(self._owners) > self.LIMIT:
                self._owners.clear()
            own = owners_among(holders, layer=-1, fault_tolerance=fault_tolerance)
            got = self._owners[key] = own, {n: j for j, o in enumerate(own.owners) for n in o}
        return got


def _single(copies: dict[int, set[int]] | dict[tuple[int, int], set[int]]) -> int:
    """How many live nodes hold the last copy of something."""
    return len({n for nodes in copies.values() if len(nodes) == 1 for n in nodes})
