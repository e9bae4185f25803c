"""Random profiles and brute-force references for the planner tests."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck
from hypothesis import strategies as st

from templates.profile import (
    RECOMPUTE_MODES,
    WEIGHT_BYTES,
    DeviceProfile,
    LayerProfile,
    MemoryModel,
    Profile,
    RecomputeCost,
)
from templates.search import PipelineTemplate
from templates.template_set import SizesMemo

SLOW_OR_FILTERED = [HealthCheck.too_slow, HealthCheck.filter_too_much]
"""Health checks to waive: a loaded 2-core machine is slow, and assume() rejects unfit clusters."""


@st.composite
def recompute_costs(draw: st.DrawFn, activation: int) -> dict[str, RecomputeCost]:
    """Some of the recomputation modes, each keeping at most `activation` bytes."""
    modes = draw(st.sets(st.sampled_from(RECOMPUTE_MODES[1:])))
    return {m: RecomputeCost(activation_bytes=draw(st.integers(0, activation)), extra=draw(st.floats(0.0, 2.0)),
                             allreduces=draw(st.integers(0, 2)), workspace_bytes=draw(st.sampled_from([0, 0, 9, 40])))
            for m in sorted(modes)}


@st.composite
def layer_profiles(draw: st.DrawFn) -> LayerProfile:
    activation = draw(st.integers(0, 60))
    return LayerProfile(
        forward=draw(st.floats(0.01, 2.0)),
        backward=draw(st.floats(0.01, 4.0)),
        param_bytes=draw(st.integers(0, 100)),
        optimizer_bytes=draw(st.integers(0, 200)),
        activation_bytes=activation,
        output_bytes=draw(st.integers(0, 50)),
        tp_allreduces=draw(st.integers(0, 4)),
        workspace_bytes=draw(st.sampled_from([0, 0, 0, 7, 30])),
        recompute=draw(recompute_costs(activation)),
    )


GRAD_BYTES_PER_PARAM = [4.0, 4.0, 5.0, 6.5, 16.0, 18.25]
"""Memory figures to draw: multiples of 1/4, so the cost model's sums are exact in floating point."""


@st.composite
def profiles(draw: st.DrawFn, min_layers: int = 1, max_layers: int = 10, tight: bool = True) -> Profile:
    """Random profiles; `tight` memory makes some layouts (and some node counts) infeasible."""
    layers = tuple(draw(st.lists(layer_profiles(), min_size=min_layers, max_size=max_layers)))
    model = MemoryModel(grad_bytes_per_param=draw(st.sampled_from(GRAD_BYTES_PER_PARAM)),
                        worker_bytes=draw(st.sampled_from([0, 0, 5, 20])))
    reserve = draw(st.sampled_from([0, 0, 3, 40]))
    need = max(layer_state(ly, model) + ly.workspace_bytes + ly.activation_bytes for ly in layers)
    fixed = reserve + model.worker_bytes
    memory = fixed + (draw(st.integers(int(need) + 1, int(need) * 4 + 2)) if tight else 10**9)
    device = DeviceProfile(
        memory_bytes=max(memory, 1),
        p2p_latency=draw(st.floats(0.0, 0.3)),
        p2p_bandwidth=draw(st.floats(10.0, 100.0)),
        allreduce_latency=draw(st.floats(0.0, 0.05)),
        allreduce_bandwidth=draw(st.floats(10.0, 100.0)),
        reserve_bytes=reserve,
    )
    return Profile(model="random", microbatch_size=1, layers=layers, device=device, memory=model)


def layer_state(layer: LayerProfile, model: MemoryModel) -> float:
    """A layer's weights, optimizer state and the engine's gradient and exchange buffers."""
    return layer.param_bytes + layer.optimizer_bytes + layer.param_bytes / WEIGHT_BYTES * model.grad_bytes_per_param


def capacity(profile: Profile, gpus: int) -> float:
    """Bytes a stage's layers may take on a node of `gpus` devices."""
    return gpus * (profile.device.memory_bytes - profile.device.reserve_bytes - profile.memory.worker_bytes)


def stage_cost(profile: Profile, gpus: int, first: int, last: int, k: int, mode: str = "none") -> tuple[float, float]:
    """(time, memory) of stage [first, last) placed k-th from the end, recomputing as `mode`
    says, summed layer by layer."""
    dev = profile.device
    layers = profile.layers[first:last]
    under = [ly.recompute.get(mode) for ly in layers]
    time = sum((ly.forward + ly.backward + (u.extra if u else 0.0)) / gpus for ly, u in zip(layers, under, strict=True))
    time += sum((ly.tp_allreduces + (u.allreduces if u else 0)) * dev.allreduce_time(ly.output_bytes, gpus)
                for ly, u in zip(layers, under, strict=True))
    if k > 1:
        time += 2 * dev.p2p_time(layers[-1].output_bytes)
    memory = sum(layer_state(ly, profile.memory) + ly.workspace_bytes + k * (u.activation_bytes if u else ly.activation_bytes)
                 for ly, u in zip(layers, under, strict=True))
    memory += max(u.workspace_bytes if u else 0 for u in under)  # one layer's rerun at a time
    if k > 1:  # a non-last stage keeps its output per microbatch in flight
        memory += k * layers[-1].output_bytes
    return time, memory


def best_stage(profile: Profile, gpus: int, first: int, last: int, k: int,
               modes: tuple[str, ...] = ("none",)) -> tuple[float, str] | None:
    """(time, mode) of the fastest of `modes` in which stage [first, last) fits at k, the first
    on ties; None when none fits."""
    room = capacity(profile, gpus)
    fitting = [(stage_cost(profile, gpus, first, last, k, m)[0], i, m) for i, m in enumerate(modes)
               if stage_cost(profile, gpus, first, last, k, m)[1] <= room]
    if not fitting:
        return None
    time, _, mode = min(fitting)
    return time, mode


def exhaustive_best(profile: Profile, gpus: int, stages: int, microbatches: int,
                    modes: tuple[str, ...] = ("none",)) -> float | None:
    """Least 1F1B iteration time over every split into `stages` stages that fits memory, each
    stage in the fastest of `modes` that fits."""
    num_layers = profile.num_layers
    best = None
    for cuts in itertools.combinations(range(1, num_layers), stages - 1):
        bounds = (0, *cuts, num_layers)
        times = []
        for s in range(stages):
            found = best_stage(profile, gpus, bounds[s], bounds[s + 1], stages - s, modes)
            if found is None:
                break
            times.append(found[0])
        else:
            value = sum(times) + (microbatches - 1) * max(times)
            if best is None or value < best:
                best = value
    return best


class FakeTemplates:
    """What `choose_sizes` reads of a TemplateSet: its templates by node count, and a memo."""

    def __init__(self, templates: dict[int, PipelineTemplate]) -> None:
        self.templates = templates
        self.sizes = sorted(templates)
        self.min_nodes = self.sizes[0]
        self.memo = SizesMemo()
        self.moment_slices = 1

    def pipelines_needed(self, fault_tolerance: int) -> int:
        return fault_tolerance + 1
