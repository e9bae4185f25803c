"""From a preset and cluster flags to pipeline templates and a plan: the runtime's use of the
planner, shared by `elastic plan`, `elastic run`, the leader's re-planning and `elastic simulate`.

Without a measured profile, the profile is derived from the preset's FLOP and byte counts on a
nominal device (`device_tflops`, `device_memory_gib`, `network_gbps`) of `device_type`: on CUDA
activations are counted in bf16 (the engine's autocast) and the device keeps a reserve for its
context and communicators. A small memory budget is how a run on this machine emulates devices
too small to hold the model, which forces multi-stage pipelines. Measured or derived, the
profile's memory figures (gradient and exchange buffers per parameter, fixed buffers per worker)
are the engine's for this cluster (`planner_figures.planner_figures`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from elastic.model.config import GPTConfig, describe_model, get_preset
from elastic.planning.activation_memory import (
    compute_bytes,
    layer_saved,
    loss_bytes_per_element,
    rerun_allreduces,
)
from elastic.planning.footprint import DEVICE_TYPES, reserve_bytes
from elastic.planning.planner_figures import planner_figures
from templates.derive import DeviceSpeed, LayerCounts, RecomputeCounts, derive_profile
from templates.instantiation import instantiate
from templates.plan import Plan
from templates.profile import PLANNED_RECOMPUTE, MemoryModel, Profile
from templates.template_set import PlanningError, TemplateSet, build_templates

DEFAULT_TFLOPS = 100.0
"""Nominal achieved TFLOP/s of one device for derived profiles."""
DEFAULT_MEMORY_GIB = 80.0
"""Nominal memory of one device for derived profiles (on CUDA, `device_type` "cuda", the
device's reserve comes off it: `footprint.RESERVE_BYTES`)."""
PARTIAL_REPLAY = True
"""Whether the engine keeps its gradient sums for partial replay (`JobSpec.partial_replay`'s
default): with more than one pipeline, a copy of the sums more per parameter."""
DEFAULT_NETWORK_GBPS = 100.0
"""Nominal inter-node bandwidth of one node's NIC in Gbit/s for derived profiles."""
GBIT = 1e9 / 8
"""Bytes per second in one Gbit/s."""


def memory_gib(given: float | None, device_type: str, *, profile: str | None = None) -> float:
    """The device memory to plan for: `given` (--device-memory-gib), else the nominal
    DEFAULT_MEMORY_GIB on CPU (or with a measured profile, which has its own), else this
    machine's GPU's memory (torch loads only here, to ask it)."""
    if given is not None:
        return float(given)
    if device_type == "cpu" or profile is not None:
        return DEFAULT_MEMORY_GIB
    from elastic.planning.memory import default_memory_gib

    return default_memory_gib(device_type)


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """What the planner needs to know about the job and the cluster (for a run, and for the
    simulator: the cluster at time 0). Validation errors name the CLI flags."""

    model: str
    """Model preset name (with `shape`: the preset the shape was derived from, a label)."""
    nodes: int
    """N: live nodes (a run's config: the largest node count; the simulator: nodes at time 0)."""
    gpus_per_node: int = 1
    """G: devices per node, the tensor-parallel degree."""
    fault_tolerance: int = 0
    """f: keep at least f+1 pipelines (the leader and the simulator's elastic policy relax it
    towards 0 when they cannot)."""
    global_batch: int = 8
    """Samples per optimizer step."""
    microbatch: int = 2
    """Samples per microbatch."""
    profile_path: str | None = None
    """Measured profile JSON; None derives one from the preset."""
    device_tflops: float = DEFAULT_TFLOPS
    """Derived profiles: achieved TFLOP/s of one device."""
    device_memory_gib: float = DEFAULT_MEMORY_GIB
    """Derived profiles: memory of one device in GiB."""
    network_gbps: float = DEFAULT_NETWORK_GBPS
    """Inter-node bandwidth of one node's NIC in Gbit/s: pipeline p2p in derived profiles, and
    the simulator's layer-shard transfers."""
    shape: GPTConfig | None = None
    """The model's shape when it is not the preset's (`--model-config`, `--n-layer`, ...);
    None: the preset `model`."""
    device_type: str = "cpu"
    """The device type the workers compute on: "cuda" plans activations in bf16 (autocast) and
    reserves the context and communicators' memory; "cpu" plans them in fp32, with no reserve."""
    recompute: str = "auto"
    """What the stages' backward recomputes: "auto" lets the planner choose per stage (the
    fastest mode that fits), a mode forces it on every stage (`templates.cost`)."""
    virtual_stages: int = 0
    """v, model chunks per node of pipelines of 2 or more nodes (`--virtual-stages`): a count
    forces it where it fits (templates/interleave.py); 0 (auto, the default) is the planner's
    choice per template, the fastest v that fits."""
    moment_slices: int = 1
    """S, the slices the run's plan counted each layer's optimizer moments in (the sharded
    optimizer: a holder keeps 1/S; `optimizer_choice.choose_plan`); 1: whole. The leader's
    re-plans keep S (f + 1) pipelines where the live nodes allow (`replan_templates`)."""
    memory_margin_bytes: int = 0
    """Bytes the templates hold back on every worker beyond the memory model's figures: set by
    `optimizer_choice.choose_plan` where the plan's uneven batch split left a worker over the
    device (the figures bound even splits); the leader's re-plans keep it."""

    def __post_init__(self) -> None:
        get_preset(self.model)  # ValueError naming the known presets
        if self.recompute not in PLANNED_RECOMPUTE:
            raise ValueError(f"--recompute must be one of {', '.join(PLANNED_RECOMPUTE)}, got {self.recompute!r}")
        if self.virtual_stages < 0:
            raise ValueError(f"--virtual-stages must be auto or >= 1, got {self.virtual_stages}")
        if self.moment_slices < 1:
            raise ValueError(f"moment slices must be >= 1, got {self.moment_slices}")
        if self.memory_margin_bytes < 0:
            raise ValueError(f"the memory margin must be >= 0 bytes, got {self.memory_margin_bytes}")
        if self.device_type not in DEVICE_TYPES:
            raise ValueError(f"device type must be one of {', '.join(DEVICE_TYPES)}, got {self.device_type!r}")
        for flag, value in (
            ("nodes", self.nodes),
            ("gpus-per-node", self.gpus_per_node),
            ("global-batch", self.global_batch),
            ("microbatch", self.microbatch),
        ):
            if value < 1:
                raise ValueError(f"--{flag} must be >= 1, got {value}")
        f = self.fault_tolerance
        if f < 0:
            raise ValueError(f"--fault-tolerance must be >= 0, got {f}")
        if self.global_batch % self.microbatch:
            raise ValueError(f"--microbatch {self.microbatch} does not divide --global-batch {self.global_batch}")
        if f + 1 > self.nodes:
            raise ValueError(f"--fault-tolerance {f} needs at least {f + 1} nodes (one per pipeline), got {self.nodes}")
        if self.global_microbatches < f + 1:
            raise ValueError(
                f"{self.global_microbatches} microbatches ({self.global_batch}/{self.microbatch}) cannot feed the "
                f"{f + 1} pipelines --fault-tolerance {f} needs"
            )
        if self.profile_path is None:
            if not (math.isfinite(self.device_tflops) and self.device_tflops > 0):
                raise ValueError(f"--device-tflops must be a positive number, got {self.device_tflops}")
            if not (math.isfinite(self.device_memory_gib) and self.device_memory_gib > 0):
                raise ValueError(f"--device-memory-gib must be a positive number, got {self.device_memory_gib}")
        if not (math.isfinite(self.network_gbps) and self.network_gbps > 0):
            raise ValueError(f"--network-gbps must be a positive number, got {self.network_gbps}")
        try:
            self.config.check_tensor_parallel(self.gpus_per_node, by=f"--gpus-per-node {self.gpus_per_node}")
        except ValueError as exc:
            raise ValueError(f"model {self.label}'s {exc}") from None

    @property
    def config(self) -> GPTConfig:
        """The model's shape: `shape`, or the preset's."""
        return self.shape if self.shape is not None else get_preset(self.model)

    @property
    def label(self) -> str:
        """The model's name in messages and profiles: the preset, and the fields `shape` changes."""
        return describe_model(self.model, self.config)

    @property
    def global_microbatches(self) -> int:
        return self.global_batch // self.microbatch

    @property
    def network_bytes_per_s(self) -> float:
        return self.network_gbps * GBIT


def gpt_layer_counts(cfg: GPTConfig, *, compute_bytes: int = 4) -> list[LayerCounts]:
    """The planner's plain description of each planning layer of `cfg`, its activations for a
    forward in `compute_bytes`-byte elements (4: fp32, 2: bf16 autocast).

    Saved activations per token (no recomputation; `activation_memory.layer_saved`): a block keeps
    14 * d_model elements in the compute dtype (LayerNorm outputs, q, k, v, attention output,
    the 4x-wide GELU input and output) and its input and mid-block residual in fp32, plus the
    attention probabilities with dropout; under autocast each microbatch also keeps a bf16 copy
    of the matmul weights. The head keeps its input and LayerNorm output, and its loss holds the
    logits in fp32 at its peak (`workspace_bytes_per_token`); the embedding keeps the token ids.
    Tensor-parallel all-reduces per microbatch: 4 per block (2 forward, 2 backward), 1 for the
    vocabulary-parallel embedding, 1 for the head's input gradient.

    Recomputation changes the blocks: `selective` keeps all but the attention core's own
    activations and runs the core's FLOPs again; `full` keeps the block's input, runs its whole
    forward again (with its 2 forward all-reduces), and its activations live again meanwhile.
    """
    d = cfg.d_model
    out = []
    for i in range(cfg.num_layers):
        kind = cfg.layer_kind(i)
        saved = layer_saved(cfg, i)
        out.append(
            LayerCounts(
                kind=kind,
                params=cfg.layer_param_count(i),
                flops_per_token=cfg.layer_flops_per_token(i),
                saved_elements_per_token=saved.elements_per_token,
                output_elements_per_token=d,
                tp_allreduces=4 if kind == "block" else 1,
                saved_bytes_per_token=saved.bytes_per_token,
                cast_params=saved.cast_params,
                workspace_bytes_per_token=saved.workspace_per_token * loss_bytes_per_element(compute_bytes),
                recompute=_block_modes(cfg, i) if kind == "block" else {},
            )
        )
    return out


def _block_modes(cfg: GPTConfig, index: int) -> dict[str, RecomputeCounts]:
    """Block `index` under `selective` (the attention core's FLOPs run again) and `full` (the
    block's forward, its all-reduces with it; its activations live again meanwhile)."""
    out = {}
    for mode, flops in (("selective", cfg.core_flops_per_token()), ("full", cfg.layer_flops_per_token(index))):
        kept = layer_saved(cfg, index, recompute=mode)
        out[mode] = RecomputeCounts(
            saved_elements_per_token=kept.elements_per_token, saved_bytes_per_token=kept.bytes_per_token,
            cast_params=kept.cast_params, flops_per_token=flops, allreduces=rerun_allreduces(mode),
            relive=mode == "full")
    return out


def derived_profile(
    name: str, cfg: GPTConfig, microbatch: int, device: DeviceSpeed, *, compute_bytes: int = 4
) -> Profile:
    return derive_profile(
        model=name, layers=gpt_layer_counts(cfg, compute_bytes=compute_bytes), seq_len=cfg.seq_len,
        microbatch_size=microbatch, device=device, compute_bytes=compute_bytes,
    )


def memory_model(spec: ClusterSpec) -> MemoryModel:
    """The engine's gradient, exchange and work buffers for `spec`'s plans (1 to min(N, M)
    pipelines of at least f+1, the batch split evenly, partial replay as the engine's default),
    and the spec's margin on every worker."""
    figures = planner_figures(
        global_microbatches=spec.global_microbatches, min_pipelines=spec.fault_tolerance + 1,
        max_pipelines=spec.nodes, partial_replay=PARTIAL_REPLAY, device_type=spec.device_type,
    )
    return MemoryModel(grad_bytes_per_param=figures.grad_bytes_per_param,
                       worker_bytes=figures.worker_bytes + spec.memory_margin_bytes)


def cluster_profile(spec: ClusterSpec) -> Profile:
    """The measured profile at `spec.profile_path`, or one derived from the preset with the
    cluster's device type, speed, memory and network bandwidth; with the engine's memory figures
    for the cluster (`memory_model`)."""
    cfg = spec.config
    if spec.profile_path is None:
        reserve = reserve_bytes(spec.device_type)
        memory = int(spec.device_memory_gib * 2**30)
        if memory <= reserve:
            raise ValueError(f"--device-memory-gib {spec.device_memory_gib:g} leaves nothing beside the "
                             f"{reserve / 2**30:g} GiB reserve of a {spec.device_type} device")
        device = DeviceSpeed(
            flops_per_second=spec.device_tflops * 1e12,
            memory_bytes=memory,
            p2p_bandwidth=spec.network_bytes_per_s,
            reserve_bytes=reserve,
            description=f"nominal {spec.device_type} device: {spec.device_tflops:g} TFLOP/s, "
            f"{spec.device_memory_gib:g} GiB, {spec.network_gbps:g} Gbit/s network",
        )
        derived = derived_profile(spec.label, cfg, spec.microbatch, device,
                                  compute_bytes=compute_bytes(spec.device_type))
        return dataclasses.replace(derived, memory=memory_model(spec))
    profile = Profile.load(spec.profile_path)  # ProfileError (a ValueError) when malformed
    if profile.num_layers != cfg.num_layers:
        raise ValueError(f"profile {spec.profile_path} has {profile.num_layers} layers but {spec.label} has {cfg.num_layers}")
    if profile.microbatch_size != spec.microbatch:
        raise ValueError(
            f"profile {spec.profile_path} was taken at microbatch {profile.microbatch_size}, not {spec.microbatch}"
        )
    return dataclasses.replace(profile, memory=memory_model(spec))


def cluster_templates(spec: ClusterSpec, *, max_nodes: int | None = None, moment_slices: int = 1) -> TemplateSet:
    """Templates for every pipeline size the cluster can use (PlanningError if none fits), each
    holder keeping 1/`moment_slices` of its optimizer moments (the sharded optimizer)."""
    return build_templates(
        cluster_profile(spec),
        gpus_per_node=spec.gpus_per_node,
        num_nodes=spec.nodes,
        fault_tolerance=spec.fault_tolerance,
        global_microbatches=spec.global_microbatches,
        max_nodes=max_nodes,
        recompute=spec.recompute,
        virtual_stages=spec.virtual_stages,
        moment_slices=moment_slices,
    )


def replan_templates(spec: ClusterSpec) -> TemplateSet:
    """The leader's templates: every pipeline size up to N (f = 0: relaxing f may need the longer
    ones), counting 1/S of the moments (S = `spec.moment_slices`, the run's plan's), and behind
    them, for node counts too small for S (f + 1) pipelines, those counting whole moments: so a
    re-plan keeps the memory the sharded plan freed wherever it can, and holds whatever S it
    gets. PlanningError if no template fits at all."""
    spec = dataclasses.replace(spec, fault_tolerance=0)
    if spec.moment_slices == 1:
        return cluster_templates(spec)
    try:
        whole: TemplateSet | None = cluster_templates(spec)
    except PlanningError:  # the model fits only with its moments sharded
        whole = None
    return dataclasses.replace(cluster_templates(spec, moment_slices=spec.moment_slices), fallback=whole)


def initial_plan(spec: ClusterSpec, tset: TemplateSet) -> Plan:
    """The fastest plan over nodes 0..N-1 with at least f+1 pipelines. With `auto`
    recomputation, a plan that recomputes somewhere gives way to the best plan without any
    recomputation when that one is predicted as fast (recomputation buys nothing there)."""
    nodes = list(range(spec.nodes))
    plan = instantiate(tset, nodes, global_microbatches=spec.global_microbatches, fault_tolerance=spec.fault_tolerance)
    if tset.recompute != "auto" or all(st.recompute == "none" for pipe in plan.pipelines for st in pipe.stages):
        return plan
    try:
        plain = instantiate(cluster_templates(dataclasses.replace(spec, recompute="none"),
                                              moment_slices=tset.moment_slices), nodes,
                            global_microbatches=spec.global_microbatches, fault_tolerance=spec.fault_tolerance)
    except PlanningError:  # nothing fits without recomputation
        return plan
    return plain if plain.iteration_time <= plan.iteration_time * (1 + 1e-9) else plan
