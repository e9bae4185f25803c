"""The Plan: a concrete instantiation of pipeline templates over live nodes.

A plan is frozen and JSON-serialisable with a schema version. It is the contract between the
planner (which writes it), the coordinator (which publishes it per generation) and the engine
(which runs it). `Plan.from_dict` validates everything a user or a peer could get wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from templates.profile import RECOMPUTE_MODES

SCHEMA_VERSION = 1


class PlanError(ValueError):
    """A plan that is malformed or inconsistent."""


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One stage: a node runs layers [first, last) tensor-parallel over its devices."""

    node: int
    """Id of the node that runs this stage."""
    layers: tuple[int, int]
    """Half-open layer range [first, last+1)."""
    recompute: str = "none"
    """What the stage's backward recomputes instead of keeping (the planner's choice, or the
    job's forced mode): "none", "selective" or "full"; plans written before read as "none"."""
    chunks: tuple[tuple[int, int], ...] = ()
    """Under the interleaved schedule (v > 1 model chunks per node): the half-open layer range
    of each chunk, chunk c of stage s being virtual stage c * p + s of its p-stage pipeline;
    `layers` is chunk 0's. Empty: one chunk, `layers` (v = 1)."""

    @property
    def first(self) -> int:
        """The first layer of chunk 0 (with v > 1 the node holds more: `held`)."""
        return self.layers[0]

    @property
    def last(self) -> int:
        """One past chunk 0's last layer (with v > 1 the node holds more: `held`)."""
        return self.layers[1]

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """The layer range of each of the node's chunks, chunk 0 first."""
        return self.chunks or (self.layers,)

    @property
    def held(self) -> tuple[int, ...]:
        """Every layer the node holds, ascending."""
        return tuple(sorted(layer for first, last in self.ranges for layer in range(first, last)))

    def holds(self, layer: int) -> bool:
        return any(first <= layer < last for first, last in self.ranges)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node": self.node, "layers": [self.layers[0], self.layers[1]],
                               "recompute": self.recompute}
        if self.chunks:
            out["chunks"] = [[first, last] for first, last in self.chunks]
        return out


@dataclass(frozen=True, kw_only=True)
class PipelinePlan:
    """One pipeline replica: stages in order, and its share of the global batch."""

    stages: tuple[StagePlan, ...]
    """Stages in pipeline order; together they hold every layer exactly once."""
    microbatches: int
    """Microbatches of the global batch this pipeline processes per step."""
    iteration_time: float = 0.0
    """Estimated time of one step of this pipeline (seconds; 0 when unknown)."""

    @cached_property
    def nodes(self) -> tuple[int, ...]:
        """The nodes in stage order (computed once: plans are frozen, and re-planning at
        thousands of nodes asks often)."""
        return tuple(s.node for s in self.stages)

    @property
    def virtual_stages(self) -> int:
        """v: model chunks per node (1: plain 1F1B; more: the interleaved schedule)."""
        return len(self.stages[0].ranges)

    @property
    def virtual_ranges(self) -> tuple[tuple[int, int], ...]:
        """The layer range of each virtual stage, in order: chunk c of stage s is number c * p + s."""
        return tuple(st.ranges[c] for c in range(self.virtual_stages) for st in self.stages)

    @cached_property
    def layout(self) -> tuple[tuple[tuple[int, int], str, tuple[tuple[int, int], ...]], ...]:
        """(layers, recompute, chunks) of each stage: what the pipeline runs, whoever runs it
        (computed once)."""
        return tuple((st.layers, st.recompute, st.chunks) for st in self.stages)

    @cached_property
    def sound_layers(self) -> int:
        """The layers [0, n) its virtual stages cover contiguously, in order, each non-empty, if
        every stage holds the same number of chunks (chunk 0 its `layers`; 2 or more stages if
        more than one), names a known recompute mode and a node id >= 0 no other stage has; -1
        if not (`Plan` validation then says what is wrong). Computed once: a re-plan keeps most
        pipelines as they were, and validating them again would cost per node."""
        stages = self.stages
        v = len(stages[0].ranges) if stages else 0
        if not stages or (v > 1 and len(stages) < 2) or len(set(self.nodes)) != len(stages):
            return -1
        for st in stages:
            if st.recompute not in RECOMPUTE_MODES or st.node < 0 or len(st.ranges) != v or (
                    st.chunks and st.chunks[0] != st.layers):
                return -1
        covered = 0
        for first, last in self.virtual_ranges:
            if first != covered or last <= first:
                return -1
            covered = last
        return covered

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": list(self.nodes),
            "stages": [s.to_dict() for s in self.stages],
            "microbatches": self.microbatches,
            "iteration_time": self.iteration_time,
            "virtual_stages": self.virtual_stages,
        }


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Pipelines covering all live nodes; the global batch split across them."""

    num_layers: int
    """Planning layers of the model (embedding, blocks, head)."""
    microbatch_size: int
    """Samples per microbatch."""
    pipelines: tuple[PipelinePlan, ...]
    """Pipeline replicas; pipeline p takes the global batch's microbatches right after those of p-1."""
    gpus_per_node: int = 1
    """Workers per node, which is the tensor-parallel degree of every stage."""
    fault_tolerance: int = 0
    """f: the plan has at least f+1 pipelines."""
    iteration_time: float = 0.0
    """Estimated step time of the slowest pipeline (seconds; 0 when unknown)."""
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _validate(self)

    # ---- derived views -------------------------------------------------------------------

    @property
    def global_microbatches(self) -> int:
        return sum(p.microbatches for p in self.pipelines)

    def spread(self, count: int) -> list[int]:
        """`count` microbatches over the pipelines in proportion to each one's share of the global
        batch, largest remainder first, ties to the lower pipeline: how a replayed step's missing
        microbatches are shared (elastic/records/partial.py), and what the simulator charges."""
        total = self.global_microbatches
        shares = [p.microbatches * count for p in self.pipelines]
        sizes = [s // total for s in shares]
        order = sorted(range(len(shares)), key=lambda p: (-(shares[p] % total), p))
        for p in order[: count - sum(sizes)]:
            sizes[p] += 1
        return sizes

    @property
    def global_batch(self) -> int:
        return self.global_microbatches * self.microbatch_size

    @cached_property
    def nodes(self) -> tuple[int, ...]:
        """All nodes of the plan, sorted (computed once)."""
        return tuple(sorted(n for p in self.pipelines for n in p.nodes))

    def microbatch_offset(self, pipeline: int) -> int:
        """Index (in the global batch) of pipeline `pipeline`'s first microbatch."""
        return sum(p.microbatches for p in self.pipelines[:pipeline])

    def locate(self, node: int) -> tuple[int, int]:
        """(pipeline, stage) run by `node`; PlanError if the node is not in the plan."""
        for p, pipe in enumerate(self.pipelines):
            for s, stage in enumerate(pipe.stages):
                if stage.node == node:
                    return p, s
        raise PlanError(f"node {node} is not part of this plan (nodes: {list(self.nodes)})")

    # ---- serialisation -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "num_layers": self.num_layers,
            "microbatch_size": self.microbatch_size,
            "gpus_per_node": self.gpus_per_node,
            "fault_tolerance": self.fault_tolerance,
            "iteration_time": self.iteration_time,
            "pipelines": [p.to_dict() for p in self.pipelines],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        if not isinstance(data, dict):
            raise PlanError(f"a plan must be a JSON object, got {type(data).__name__}")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanError(f"unsupported plan schema_version {version!r} (this code reads {SCHEMA_VERSION})")
        try:
            pipelines = tuple(
                PipelinePlan(
                    stages=tuple(
                        StagePlan(node=_int(s["node"], "node"), layers=_range(s["layers"]),
                                  recompute=s.get("recompute", "none"),
                                  chunks=tuple(_range(c) for c in _list(s.get("chunks", []), "chunks")))
                        for s in p["stages"]
                    ),
                    microbatches=_int(p["microbatches"], "microbatches"),
                    iteration_time=float(p.get("iteration_time", 0.0)),
                )
                for p in data["pipelines"]
            )
            return cls(
                num_layers=_int(data["num_layers"], "num_layers"),
                microbatch_size=_int(data["microbatch_size"], "microbatch_size"),
                pipelines=pipelines,
                gpus_per_node=_int(data.get("gpus_per_node", 1), "gpus_per_node"),
                fault_tolerance=_int(data.get("fault_tolerance", 0), "fault_tolerance"),
                iteration_time=float(data.get("iteration_time", 0.0)),
            )
        except KeyError as exc:
            raise PlanError(f"plan is missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, PlanError):
                raise
            raise PlanError(f"malformed plan: {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan is not valid JSON: {exc}") from None
        return cls.from_dict(data)


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{name} must be an integer, got {value!r}")
    return value


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise PlanError(f"{name} must be a list, got {value!r}")
    return value


def _range(value: Any) -> tuple[int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise PlanError(f"layers must be [first, last+1], got {value!r}")
    return (_int(value[0], "layers[0]"), _int(value[1], "layers[1]"))


def _validate(plan: Plan) -> None:
    if plan.num_layers < 1:
        raise PlanError(f"num_layers must be >= 1, got {plan.num_layers}")
    if plan.microbatch_size < 1:
        raise PlanError(f"microbatch_size must be >= 1, got {plan.microbatch_size}")
    if plan.gpus_per_node < 1:
        raise PlanError(f"gpus_per_node must be >= 1, got {plan.gpus_per_node}")
    if not plan.pipelines:
        raise PlanError("a plan needs at least one pipeline")
    if len(plan.pipelines) < plan.fault_tolerance + 1:
        raise PlanError(
            f"plan has {len(plan.pipelines)} pipelines; fault tolerance {plan.fault_tolerance} needs at least "
            f"{plan.fault_tolerance + 1}"
        )
    if _sound(plan):
        return
    seen: set[int] = set()
    for p, pipe in enumerate(plan.pipelines):
        if pipe.microbatches < 1:
            raise PlanError(f"pipeline {p} has {pipe.microbatches} microbatches; each needs at least 1")
        if not pipe.stages:
            raise PlanError(f"pipeline {p} has no stages")
        _check_chunks(p, pipe)
        expected_first = 0
        for k, (first, last) in enumerate(pipe.virtual_ranges):
            if first != expected_first or last <= first:
                where = f"stage {k}" if pipe.virtual_stages == 1 else (
                    f"virtual stage {k} (stage {k % len(pipe.stages)} chunk {k // len(pipe.stages)})")
                raise PlanError(
                    f"pipeline {p} {where} holds layers [{first}, {last}); stages must cover "
                    f"[0, {plan.num_layers}) contiguously, in order, each non-empty"
                )
            expected_first = last
        for s, stage in enumerate(pipe.stages):
            if stage.recompute not in RECOMPUTE_MODES:
                raise PlanError(f"pipeline {p} stage {s} recompute must be one of {', '.join(RECOMPUTE_MODES)}, "
                                f"got {stage.recompute!r}")
            if stage.node in seen:
                raise PlanError(f"node {stage.node} appears more than once in the plan")
            if stage.node < 0:
                raise PlanError(f"node ids must be >= 0, got {stage.node}")
            seen.add(stage.node)
        if expected_first != plan.num_layers:
            raise PlanError(f"pipeline {p} covers layers [0, {expected_first}) but the model has {plan.num_layers}")


def _sound(plan: Plan) -> bool:
    """Whether every pipeline is sound (`PipelinePlan.sound_layers`, cached) over all the layers,
    has a microbatch, and no node is in two pipelines: a valid plan, known without a pass over
    its stages when the re-planner kept its pipelines. The stage-by-stage checks run only when
    this says no, to name the first thing wrong."""
    nodes: list[int] = []
    for pipe in plan.pipelines:
        if pipe.microbatches < 1 or pipe.sound_layers != plan.num_layers:
            return False
        nodes.extend(pipe.nodes)
    return len(set(nodes)) == len(nodes)


def describe_ranges(ranges: tuple[tuple[int, int], ...]) -> str:
    """A stage's layers as people read them: "[0,3)", or "[0,2)+[4,6)" for two chunks."""
    return "+".join(f"[{first},{last})" for first, last in ranges)


def _check_chunks(p: int, pipe: PipelinePlan) -> None:
    """Every stage of an interleaved pipeline has the same number of chunks, chunk 0 its `layers`."""
    v = pipe.virtual_stages
    for s, stage in enumerate(pipe.stages):
        if stage.chunks and stage.chunks[0] != stage.layers:
            raise PlanError(f"pipeline {p} stage {s}: chunk 0 {list(stage.chunks[0])} is not its layers "
                            f"{list(stage.layers)}")
        if len(stage.ranges) != v:
            raise PlanError(f"pipeline {p} stage {s} has {len(stage.ranges)} chunks, stage 0 has {v}: "
                            "every stage of a pipeline holds the same number")
    if v > 1 and len(pipe.stages) < 2:
        raise PlanError(f"pipeline {p} has one stage and {v} chunks: interleaving needs at least 2 stages")


def even_plan(
    *,
    num_layers: int,
    nodes: list[int] | tuple[int, ...],
    num_pipelines: int,
    global_microbatches: int,
    microbatch_size: int,
    gpus_per_node: int = 1,
    fault_tolerance: int = 0,
    virtual_stages: int = 1,
) -> Plan:
    """A simple hand-built plan: nodes dealt into `num_pipelines` pipelines as evenly as
    possible, layers split evenly over each pipeline's stages (over its p * v virtual stages,
    chunk c of stage s holding virtual stage c * p + s, in pipelines of 2 or more stages),
    microbatches split evenly."""
    if num_pipelines < 1 or num_pipelines > len(nodes):
        raise PlanError(f"cannot form {num_pipelines} pipelines from {len(nodes)} nodes")
    if global_microbatches < num_pipelines:
        raise PlanError(f"{global_microbatches} microbatches cannot feed {num_pipelines} pipelines")
    node_list = sorted(nodes)
    pipelines = []
    start = 0
    for p in range(num_pipelines):
        depth = len(node_list) // num_pipelines + (1 if p < len(node_list) % num_pipelines else 0)
        if depth > num_layers:
            raise PlanError(f"a pipeline of {depth} stages cannot split {num_layers} layers")
        members = node_list[start : start + depth]
        start += depth
        v = virtual_stages if depth > 1 else 1
        if depth * v > num_layers:
            raise PlanError(f"a pipeline of {depth} stages x {v} chunks cannot split {num_layers} layers")
        bounds = [round(i * num_layers / (depth * v)) for i in range(depth * v + 1)]
        ranges = [tuple((bounds[c * depth + i], bounds[c * depth + i + 1]) for c in range(v)) for i in range(depth)]
        stages = tuple(StagePlan(node=n, layers=ranges[i][0], chunks=ranges[i] if v > 1 else ())
                       for i, n in enumerate(members))
        mbs = global_microbatches // num_pipelines + (1 if p < global_microbatches % num_pipelines else 0)
        pipelines.append(PipelinePlan(stages=stages, microbatches=mbs))
    return Plan(
        num_layers=num_layers,
        microbatch_size=microbatch_size,
        pipelines=tuple(pipelines),
        gpus_per_node=gpus_per_node,
        fault_tolerance=fault_tolerance,
    )
