"""The profile: what the planner knows about each layer and about the devices.

A profile is versioned JSON. Times are seconds for ONE microbatch on ONE device (no tensor
parallelism); bytes are full (unsharded) sizes. Memory accounting assumes fp32 master weights
(4 bytes per parameter, so a layer has `param_bytes` / 4 parameters) with AdamW: a layer's
static memory is its weights (`param_bytes`), the two AdamW moments (`optimizer_bytes`) and the
engine's gradient and exchange buffers (`memory.grad_bytes_per_param` per parameter); each
worker also keeps `memory.worker_bytes` of fixed work buffers, and `device.reserve_bytes` of
each device hold no training tensor (the CUDA context, the communicators). The planner imports
nothing of the engine: these figures come as numbers, from `elastic/planning/planner_figures.py`.
Activation bytes are in the compute dtype the profile was taken or derived for. `source` says
whether the numbers were measured on a device or derived from FLOP/byte counts.

Activation recomputation: a layer's `recompute` maps a mode ("selective", "full") to what the
layer keeps under it and what it runs again in its backward (`RecomputeCost`). A mode a layer
does not name leaves it as it is (the embedding and the head; every layer of a profile written
before the modes existed, so the planner keeps everything there).

Files written before the memory figures existed read with the old model: one fp32 gradient per
parameter (`grad_bytes_per_param` 4), no reserve, no fixed buffers, no workspace.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_VERSION = 1
SOURCES = ("measured", "derived")
WEIGHT_BYTES = 4
"""Bytes of one parameter's master weight (fp32): `param_bytes` / WEIGHT_BYTES parameters."""
RECOMPUTE_MODES = ("none", "selective", "full")
"""What a stage's backward recomputes instead of keeping, cheapest in memory last (the engine's
`elastic.model.config.RECOMPUTE_MODES`); the planner picks one per stage, or is told one."""
PLANNED_RECOMPUTE = (*RECOMPUTE_MODES, "auto")
"""What the planner may be told: one mode for every stage, or "auto" (its choice per stage)."""


class ProfileError(ValueError):
    """A profile that is malformed or inconsistent."""


@dataclass(frozen=True, kw_only=True)
class RecomputeCost:
    """One layer under one recomputation mode, for one microbatch on one device."""

    activation_bytes: int
    """Bytes kept from forward to backward under the mode (instead of `activation_bytes`)."""
    extra: float
    """Seconds of forward run again in the backward."""
    allreduces: int = 0
    """Tensor-parallel all-reduces of `output_bytes` the rerun adds (full: the forward's)."""
    workspace_bytes: int = 0
    """Bytes that live again while the layer's backward reruns it (full: its activations); a
    stage counts the largest of its layers', once."""

    def to_dict(self) -> dict[str, Any]:
        return {"activation_bytes": self.activation_bytes, "extra": self.extra, "allreduces": self.allreduces,
                "workspace_bytes": self.workspace_bytes}

    @classmethod
    def from_dict(cls, data: Any, mode: str) -> RecomputeCost:
        if not isinstance(data, dict):
            raise ProfileError(f"recompute {mode!r} must be a JSON object, got {type(data).__name__}")
        try:
            return cls(activation_bytes=_int(data["activation_bytes"], "activation_bytes"),
                       extra=_num(data["extra"], "extra"), allreduces=_int(data.get("allreduces", 0), "allreduces"),
                       workspace_bytes=_int(data.get("workspace_bytes", 0), "workspace_bytes"))
        except KeyError as exc:
            raise ProfileError(f"recompute {mode!r} is missing field {exc.args[0]!r}") from None


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """Cost of one planning layer for one microbatch on one device."""

    forward: float
    """Forward time in seconds."""
    backward: float
    """Backward time in seconds (measured or derived separately, never a fixed multiple)."""
    param_bytes: int
    """Bytes of the layer's weights."""
    optimizer_bytes: int
    """Bytes of the layer's optimizer state (AdamW moments)."""
    activation_bytes: int
    """Bytes kept alive from forward to backward for one microbatch."""
    output_bytes: int
    """Bytes of the layer's output for one microbatch: what a p2p send or a TP all-reduce moves."""
    tp_allreduces: int = 0
    """All-reduces of `output_bytes` per microbatch (forward + backward) when tensor-parallel."""
    workspace_bytes: int = 0
    """Transient bytes at the layer's peak beyond what it keeps, for one microbatch, counted once
    per stage whatever its microbatches in flight (the head: its fp32 loss over the logits)."""
    recompute: Mapping[str, RecomputeCost] = field(default_factory=dict)
    """Per recomputation mode other than "none", the layer under it; a mode absent here leaves
    the layer as it is."""

    def under(self, mode: str) -> RecomputeCost:
        """The layer under `mode` ("none": as it is, nothing run again)."""
        cost = self.recompute.get(mode)
        return cost if cost is not None else RecomputeCost(activation_bytes=self.activation_bytes, extra=0.0)

    def to_dict(self) -> dict[str, Any]:
        modes = {"recompute": {m: c.to_dict() for m, c in self.recompute.items()}} if self.recompute else {}
        return modes | {
            "forward": self.forward,
            "backward": self.backward,
            "param_bytes": self.param_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "activation_bytes": self.activation_bytes,
            "output_bytes": self.output_bytes,
            "tp_allreduces": self.tp_allreduces,
            "workspace_bytes": self.workspace_bytes,
        }


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """Memory and link costs of one device and the links between devices and nodes."""

    memory_bytes: int
    """Memory of one device."""
    p2p_latency: float
    """Seconds of fixed cost of one point-to-point transfer between nodes."""
    p2p_bandwidth: float
    """Bytes per second of a point-to-point transfer between nodes."""
    allreduce_latency: float
    """Seconds of fixed cost per ring step of an all-reduce among the devices of a node."""
    allreduce_bandwidth: float
    """Bytes per second of one ring link inside a node."""
    reserve_bytes: int = 0
    """Bytes of `memory_bytes` that hold no training tensor: the CUDA context and the
    communicators' buffers (0 on the CPU)."""

    @property
    def budget_bytes(self) -> int:
        """Bytes of one device for weights, optimizer state, gradients, buffers and activations."""
        return self.memory_bytes - self.reserve_bytes

    def p2p_time(self, nbytes: float) -> float:
        """Seconds to send `nbytes` from one node to the next."""
        return self.p2p_latency + nbytes / self.p2p_bandwidth

    def allreduce_time(self, nbytes: float, workers: int) -> float:
        """Seconds of a ring all-reduce of `nbytes` among `workers` devices (0 for one worker)."""
        if workers <= 1:
            return 0.0
        steps = 2 * (workers - 1)
        return steps * self.allreduce_latency + steps / workers * nbytes / self.allreduce_bandwidth

    def to_dict(self) -> dict[str, Any]:
        return {
            "memory_bytes": self.memory_bytes,
            "p2p_latency": self.p2p_latency,
            "p2p_bandwidth": self.p2p_bandwidth,
            "allreduce_latency": self.allreduce_latency,
            "allreduce_bandwidth": self.allreduce_bandwidth,
            "reserve_bytes": self.reserve_bytes,
        }


@dataclass(frozen=True, kw_only=True)
class MemoryModel:
    """The engine's memory beyond the layers' weights, moments and activations, as numbers (the
    planner imports nothing of the engine: `elastic/planning/planner_figures.py` computes them for the
    cluster being planned)."""

    grad_bytes_per_param: float = 4.0
    """Bytes per parameter of gradient buffers (sums, reduced gradient, snapshot, tree scratch)
    and exchange buffers; 4.0 (the default): one fp32 gradient."""
    worker_bytes: int = 0
    """Bytes per worker that do not grow with its stage (work buffers)."""

    def to_dict(self) -> dict[str, Any]:
        return {"grad_bytes_per_param": self.grad_bytes_per_param, "worker_bytes": self.worker_bytes}

    @classmethod
    def from_dict(cls, data: Any) -> MemoryModel:
        if not isinstance(data, dict):
            raise ProfileError(f"profile memory must be a JSON object, got {type(data).__name__}")
        return cls(
            grad_bytes_per_param=_num(data.get("grad_bytes_per_param", 4.0), "grad_bytes_per_param"),
            worker_bytes=_int(data.get("worker_bytes", 0), "worker_bytes"),
        )


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Per-layer costs of a model at one microbatch size, plus the device they apply to."""

    model: str
    """Name of the profiled model (a preset name or free text)."""
    microbatch_size: int
    """Samples per microbatch the layer numbers refer to."""
    layers: tuple[LayerProfile, ...]
    """One entry per planning layer, in model order."""
    device: DeviceProfile
    """The device and link model."""
    source: str = "derived"
    """'measured' (timed on a device) or 'derived' (FLOP/byte counts scaled by a device speed)."""
    notes: str = ""
    """Free text: assumptions, the device, how it was measured."""
    memory: MemoryModel = MemoryModel()
    """The engine's gradient, exchange and work buffers, for the cluster being planned."""
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_bytes(self, index: int) -> int:
        """Bytes a node must receive to take over layer `index`: weights plus optimizer state."""
        layer = self.layers[index]
        return layer.param_bytes + layer.optimizer_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "model": self.model,
            "microbatch_size": self.microbatch_size,
            "source": self.source,
            "notes": self.notes,
            "device": self.device.to_dict(),
            "memory": self.memory.to_dict(),
            "layers": [layer.to_dict() for layer in self.layers],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        if not isinstance(data, dict):
            raise ProfileError(f"a profile must be a JSON object, got {type(data).__name__}")
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(
                f"unsupported profile version {data.get('version')!r} (this code reads {PROFILE_VERSION})"
            )
        try:
            dev = data["device"]
            device = DeviceProfile(
                memory_bytes=_int(dev["memory_bytes"], "memory_bytes"),
                p2p_latency=_num(dev["p2p_latency"], "p2p_latency"),
                p2p_bandwidth=_num(dev["p2p_bandwidth"], "p2p_bandwidth"),
                allreduce_latency=_num(dev["allreduce_latency"], "allreduce_latency"),
                allreduce_bandwidth=_num(dev["allreduce_bandwidth"], "allreduce_bandwidth"),
                reserve_bytes=_int(dev.get("reserve_bytes", 0), "reserve_bytes"),
            )
            layers = tuple(
                LayerProfile(
                    forward=_num(layer["forward"], "forward"),
                    backward=_num(layer["backward"], "backward"),
                    param_bytes=_int(layer["param_bytes"], "param_bytes"),
                    optimizer_bytes=_int(layer["optimizer_bytes"], "optimizer_bytes"),
                    activation_bytes=_int(layer["activation_bytes"], "activation_bytes"),
                    output_bytes=_int(layer["output_bytes"], "output_bytes"),
                    tp_allreduces=_int(layer.get("tp_allreduces", 0), "tp_allreduces"),
                    workspace_bytes=_int(layer.get("workspace_bytes", 0), "workspace_bytes"),
                    recompute=_modes(layer.get("recompute", {})),
                )
                for layer in data["layers"]
            )
            return cls(
                model=str(data["model"]),
                microbatch_size=_int(data["microbatch_size"], "microbatch_size"),
                layers=layers,
                device=device,
                source=str(data.get("source", "derived")),
                notes=str(data.get("notes", "")),
                memory=MemoryModel.from_dict(data.get("memory", {})),
            )
        except KeyError as exc:
            raise ProfileError(f"profile is missing field {exc.args[0]!r}") from None
        except TypeError as exc:
            raise ProfileError(f"malformed profile: {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> Profile:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"profile is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ProfileError(f"cannot read profile {str(path)!r}: {exc.strerror}") from None
        return cls.from_json(text)


def _modes(data: Any) -> dict[str, RecomputeCost]:
    if not isinstance(data, dict):
        raise ProfileError(f"a layer's recompute must be a JSON object, got {type(data).__name__}")
    return {str(mode): RecomputeCost.from_dict(cost, str(mode)) for mode, cost in data.items()}


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProfileError(f"{name} must be an integer, got {value!r}")
    return value


def _num(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{name} must be a number, got {value!r}")
    return float(value)


def _validate(profile: Profile) -> None:
    if profile.source not in SOURCES:
        raise ProfileError(f"profile source must be one of {SOURCES}, got {profile.source!r}")
    if profile.microbatch_size < 1:
        raise ProfileError(f"microbatch_size must be >= 1, got {profile.microbatch_size}")
    if not profile.layers:
        raise ProfileError("a profile needs at least one layer")
    dev = profile.device
    if dev.memory_bytes <= 0:
        raise ProfileError(f"device memory_bytes must be > 0, got {dev.memory_bytes}")
    if not 0 <= dev.reserve_bytes < dev.memory_bytes:
        raise ProfileError(f"device reserve_bytes must be >= 0 and below memory_bytes, got {dev.reserve_bytes}")
    mem = profile.memory
    if not (math.isfinite(mem.grad_bytes_per_param) and mem.grad_bytes_per_param >= 0) or mem.worker_bytes < 0:
        raise ProfileError(f"memory figures must be >= 0, got {mem}")
    for name in ("p2p_bandwidth", "allreduce_bandwidth"):
        value = getattr(dev, name)
        if not (math.isfinite(value) and value > 0):
            raise ProfileError(f"device {name} must be a positive number, got {value}")
    for name in ("p2p_latency", "allreduce_latency"):
        value = getattr(dev, name)
        if not (math.isfinite(value) and value >= 0):
            raise ProfileError(f"device {name} must be a number >= 0, got {value}")
    for i, layer in enumerate(profile.layers):
        for name in ("forward", "backward"):
            value = getattr(layer, name)
            if not (math.isfinite(value) and value >= 0):
                raise ProfileError(f"layer {i} {name} time must be a number >= 0, got {value}")
        for name in ("param_bytes", "optimizer_bytes", "activation_bytes", "output_bytes", "tp_allreduces",
                     "workspace_bytes"):
            if getattr(layer, name) < 0:
                raise ProfileError(f"layer {i} {name} must be >= 0, got {getattr(layer, name)}")
        for mode, cost in layer.recompute.items():
            if mode not in RECOMPUTE_MODES[1:]:
                raise ProfileError(f"layer {i} recompute mode must be one of {RECOMPUTE_MODES[1:]}, got {mode!r}")
            if min(cost.activation_bytes, cost.allreduces, cost.workspace_bytes) < 0 or not (
                    math.isfinite(cost.extra) and cost.extra >= 0):
                raise ProfileError(f"layer {i} recompute {mode!r} figures must be >= 0, got {cost}")
