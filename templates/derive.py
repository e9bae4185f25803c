"""A profile derived from FLOP and byte counts instead of timing the model.

Used for models too large to run here and for `elastic plan`'s instant default. Each layer is
described by plain counts (the planner knows nothing of the model code); its times are its
FLOPs divided by a device speed. Backward is counted as 2x the forward FLOPs (gradients with
respect to inputs and to weights), which is a FLOP count, not a measurement: a measured
profile times backward on its own. Sizes assume fp32 master weights and AdamW (two fp32
moments per parameter); activations and stage outputs (what travels between stages and in a
TP all-reduce) are counted in the compute dtype (`compute_bytes` per element: 4 for fp32, 2
under bf16 autocast, which then also keeps a bf16 copy of the matmul weights per microbatch),
beside the bytes that stay fp32 whatever it is. What the engine keeps
for gradients and their exchange is the profile's `memory` (a default here; the caller that
knows the cluster replaces it). A layer that recomputation changes describes each mode
(`RecomputeCounts`): what it keeps under it and the forward FLOPs its backward runs again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from templates.profile import DeviceProfile, LayerProfile, Profile, RecomputeCost

BYTES_PER_ELEMENT = 4
"""fp32: weights and moments, and activations and stage outputs unless told otherwise."""
ADAMW_STATE_PER_PARAM = 2
"""exp_avg and exp_avg_sq, one fp32 each."""


@dataclass(frozen=True, kw_only=True)
class RecomputeCounts:
    """One planning layer under one recomputation mode."""

    saved_elements_per_token: float
    """Elements kept per token in the compute dtype under the mode."""
    flops_per_token: float
    """Forward FLOPs per token the backward runs again."""
    saved_bytes_per_token: float = 0.0
    """Bytes kept per token whatever the compute dtype."""
    cast_params: int = 0
    """Weight elements autocast copies and keeps under the mode."""
    allreduces: int = 0
    """Tensor-parallel all-reduces of the output the rerun adds per microbatch."""
    relive: bool = False
    """Whether the layer's activations (as kept without recomputation) live again while its
    backward reruns it (full recomputation)."""


@dataclass(frozen=True, kw_only=True)
class LayerCounts:
    """Size and work of one planning layer, per token or per parameter."""

    kind: str
    """Free-text layer kind ('embedding', 'block', 'head', ...), kept in the profile notes."""
    params: int
    """Number of parameters."""
    flops_per_token: float
    """Forward FLOPs per token (2 per multiply-add)."""
    saved_elements_per_token: float
    """Elements kept from forward to backward per token, in the compute dtype."""
    output_elements_per_token: int
    """Elements of the layer's output per token (what is sent to the next stage)."""
    tp_allreduces: int = 0
    """All-reduces of the output per microbatch (forward + backward) under tensor parallelism."""
    saved_bytes_per_token: float = 0.0
    """Bytes kept from forward to backward per token whatever the compute dtype (fp32 residual
    stream and statistics, token ids, masks)."""
    cast_params: int = 0
    """Weight elements copied to the compute dtype per microbatch and kept for the backward
    (autocast's copies: none when the compute dtype is fp32)."""
    workspace_bytes_per_token: float = 0.0
    """Transient bytes per token at the layer's peak beyond what it keeps (the head's loss)."""
    recompute: Mapping[str, RecomputeCounts] = field(default_factory=dict)
    """The layer under each recomputation mode that changes it."""


@dataclass(frozen=True, kw_only=True)
class DeviceSpeed:
    """The device the derived times and the memory budget refer to."""

    flops_per_second: float
    """Achieved FLOP/s of one device on the model's matmuls."""
    memory_bytes: int
    """Memory budget of one device."""
    p2p_latency: float = 20e-6
    """Seconds of fixed cost of one inter-node transfer."""
    p2p_bandwidth: float = 12.5e9
    """Inter-node bytes per second (100 Gbit/s by default)."""
    allreduce_latency: float = 5e-6
    """Seconds per ring step of an intra-node all-reduce."""
    allreduce_bandwidth: float = 150e9
    """Intra-node bytes per second per ring link."""
    reserve_bytes: int = 0
    """Bytes of `memory_bytes` that hold no training tensor (CUDA context, communicators)."""
    description: str = ""
    """Where these numbers come from."""

    def device_profile(self) -> DeviceProfile:
        """The profile's per-device part: memory budget and link costs."""
        return DeviceProfile(
            memory_bytes=self.memory_bytes,
            p2p_latency=self.p2p_latency,
            p2p_bandwidth=self.p2p_bandwidth,
            allreduce_latency=self.allreduce_latency,
            allreduce_bandwidth=self.allreduce_bandwidth,
            reserve_bytes=self.reserve_bytes,
        )


def derive_profile(
    *,
    model: str,
    layers: Sequence[LayerCounts],
    seq_len: int,
    microbatch_size: int,
    device: DeviceSpeed,
    compute_bytes: int = BYTES_PER_ELEMENT,
) -> Profile:
    """The profile of `layers` at `microbatch_size` samples of `seq_len` tokens on `device`, with
    activations of `compute_bytes` per element."""
    if seq_len < 1 or microbatch_size < 1:
        raise ValueError(f"seq_len and microbatch_size must be >= 1, got {seq_len} and {microbatch_size}")
    if not device.flops_per_second > 0:
        raise ValueError(f"flops_per_second must be > 0, got {device.flops_per_second}")
    if compute_bytes < 1:
        raise ValueError(f"compute_bytes must be >= 1, got {compute_bytes}")
    tokens = seq_len * microbatch_size
    out = []

    def kept(elements: float, fp32_bytes: float, cast_params: int) -> int:
        cast = cast_params * compute_bytes if compute_bytes < BYTES_PER_ELEMENT else 0
        return int(tokens * (elements * compute_bytes + fp32_bytes)) + cast

    for layer in layers:
        forward = layer.flops_per_token * tokens / device.flops_per_second
        activation = kept(layer.saved_elements_per_token, layer.saved_bytes_per_token, layer.cast_params)
        modes = {
            mode: RecomputeCost(
                activation_bytes=kept(c.saved_elements_per_token, c.saved_bytes_per_token, c.cast_params),
                extra=c.flops_per_token * tokens / device.flops_per_second, allreduces=c.allreduces,
                workspace_bytes=activation if c.relive else 0)
            for mode, c in layer.recompute.items()
        }
        out.append(
            LayerProfile(
                forward=forward,
                backward=2.0 * forward,
                param_bytes=layer.params * BYTES_PER_ELEMENT,
                optimizer_bytes=layer.params * BYTES_PER_ELEMENT * ADAMW_STATE_PER_PARAM,
                activation_bytes=activation,
                output_bytes=layer.output_elements_per_token * tokens * compute_bytes,
                tp_allreduces=layer.tp_allreduces,
                workspace_bytes=int(layer.workspace_bytes_per_token * tokens),
                recompute=modes,
            )
        )
    kinds = ", ".join(f"{kind} x{sum(1 for ly in layers if ly.kind == kind)}" for kind in _kinds(layers))
    notes = (
        f"derived from FLOP/byte counts at {device.flops_per_second:.3g} FLOP/s per device"
        f"{' (' + device.description + ')' if device.description else ''}; backward = 2x forward FLOPs; "
        f"fp32 weights and AdamW moments, {compute_bytes}-byte activations; layers: {kinds}"
    )
    return Profile(
        model=model,
        microbatch_size=microbatch_size,
        layers=tuple(out),
        device=device.device_profile(),
        source="derived",
        notes=notes,
    )


def _kinds(layers: Sequence[LayerCounts]) -> list[str]:
    seen: list[str] = []
    for layer in layers:
        if layer.kind not in seen:
            seen.append(layer.kind)
    return seen
