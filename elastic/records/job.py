"""JobSpec: everything a worker needs to know about a training job, as one JSON file.

The launcher writes it once; every worker reads the same file, so every worker agrees on the
model, the plan, the data and the optimizer without talking to the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic.coordinator.jsonrecord import JsonRecord, from_data
from elastic.model.config import PLANNED_RECOMPUTE, GPTConfig, get_preset
from elastic.records.optim_config import OptimConfig
from templates.plan import Plan

DEVICE_BASE_ENV = "ELASTIC_DEVICE_BASE"
"""Environment variable: the first accelerator index of a node's workers on its host (their
device is base + local rank). The launcher sets it for each simulated node it starts on one
host (node * workers per node), so no two nodes share a GPU; unset (0) for one node per host."""


SHARD_OPTIMIZER = ("off", "on", "auto")
"""`JobSpec.shard_optimizer`'s values."""


@dataclass(frozen=True, kw_only=True)
class JobSpec(JsonRecord):
    """A training job: model, plan, data, optimizer and where results go."""

    model: str
    """Name of the model preset (elastic.model.config.PRESETS)."""
    plan: Plan
    """The plan of generation `generation`."""
    steps: int
    """Optimizer steps to run (steps [0, steps))."""
    run_dir: str
    """Directory for the job's logs and per-worker outputs."""
    generation: int = 0
    """Plan version; names the store prefix of the process groups."""
    data_seed: int = 0
    """Seed of the sample order (sample i depends on the corpus, this seed and i)."""
    data_path: str | None = None
    """Corpus file; None uses the built-in corpus."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    device: str = "auto"
    """"auto" (accelerator when present), "cpu" or "cuda"."""
    threads_per_worker: int = 1
    """torch intra-op threads of each worker process (CPU runs share few cores)."""
    exact_grad_sum: bool = True
    """Sum gradients in the step's one summation tree (a fixed pairwise float32 sum over the
    global batch's microbatches, elastic/parallel/blocks.py), so the global-batch gradient does
    not depend on how the plan splits microbatches across pipelines, at the bytes of DDP's
    float32 all-reduce (False: each pipeline's share all-reduced by gloo's ring, whose sum
    depends on the plan: a run with failures then drifts from the failure-free run as it goes
    on, 2e-4 after 160 tiny steps; see bench/README.md, "Engine vs DDP")."""
    shard_transport: str = "collective"
    """How a reconfiguration moves shards between workers of the new generation: "collective"
    (point-to-point sends on its process group, gloo or NCCL; gRPC only for shards held
    outside it and as the fallback) or "grpc" (every shard over gRPC)."""
    partial_replay: bool = True
    """When a node fails mid-step, pipelines that lost no node finish their microbatches and
    keep their gradient sums, and the next generation computes only the rest of the step
    (elastic/records/partial.py). Costs one copy of each worker's gradient sums per step."""
    collective_timeout_s: float = 120.0
    """Timeout of every collective and transfer, so no worker waits forever on a dead peer."""
    recompute: str = "auto"
    """What the stages' backward recomputes (`elastic run --recompute`, model/gpt.py): "auto"
    (default: each stage as its plan says, the planner's choice), or forced on every stage:
    "none", "selective" (the attention core) or "full" (each block from its input). The
    gradients are the same, bit for bit, in every mode."""
    sequence_parallel: bool | None = None
    """Split the activations between the tensor-parallel regions along the sequence
    (`elastic run --sequence-parallel/--no-sequence-parallel`, model/gpt.py); None (default): on
    where the plan is tensor-parallel. The same function as without it, summed in another order."""
    scatter_gather: bool = True
    """With tensor parallelism and no sequence parallelism, each rank sends 1/t of every
    stage-boundary tensor and the receiving node all-gathers it (`elastic run
    --no-scatter-gather` sends whole tensors; elastic/parallel/executor.py). Bit-identical."""
    shard_optimizer: str = "auto"
    """Shard AdamW's moments across each layer's holders, f + 1 copies of every slice
    (`elastic run --shard-optimizer off|on|auto`, issue 55, elastic/engine/optim_shards.py):
    each holder keeps (f + 1) / P of a layer's moments and updates only its slice, and the
    other parameters reach it at the start of the next step. Bit-identical to "off". `elastic run`
    resolves "auto" (the default) to the planner's choice before writing the spec
    (`planning.optimizer_choice.choose_plan`); a spec that still says "auto" is not sharded."""
    # ---- evaluation (`elastic run --eval-every N --eval-batches K`, elastic/engine/eval.py) ----
    eval_every: int = 0
    """Compute the validation loss after every this many committed steps and after the last
    (0: never). With it, the tail of the corpus is held out: training windows come from the rest
    (elastic/data/dataset.py), so training samples differ from those of a run without it."""
    eval_batches: int = 8
    """Held-out microbatches (of the plan's microbatch size) each evaluation averages over."""
    # ---- model shape (--model-config, --n-layer, ...) ---------------------------------------
    init_from: str | None = None
    """`--init-from DIR`: a Hugging Face checkpoint directory every worker that starts from nothing
    reads its own shards from (elastic/model/hf_import.py), instead of the seeded initialisation."""
    shape: GPTConfig | None = None
    """The model's resolved shape when it is not the preset's; None: the preset `model`. Every
    worker, checkpoint and summary reads the shape through `model_config`."""

    def __post_init__(self) -> None:
        get_preset(self.model)
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if self.plan.num_layers != self.model_config.num_layers:
            raise ValueError(
                f"plan has {self.plan.num_layers} layers but model {self.model!r} has "
                f"{self.model_config.num_layers}"
            )
        if self.threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {self.threads_per_worker}")
        if self.recompute not in PLANNED_RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(PLANNED_RECOMPUTE)}, got {self.recompute!r}")
        if self.shard_transport not in ("collective", "grpc"):
            raise ValueError(f"shard_transport must be 'collective' or 'grpc', got {self.shard_transport!r}")
        if self.shard_optimizer not in SHARD_OPTIMIZER:
            raise ValueError(f"shard_optimizer must be one of {', '.join(SHARD_OPTIMIZER)}, got {self.shard_optimizer!r}")
        if self.eval_every < 0 or self.eval_batches < 1:
            raise ValueError(f"need eval_every >= 0 and eval_batches >= 1, got {self.eval_every} and {self.eval_batches}")

    @property
    def model_config(self) -> GPTConfig:
        """The model's shape: `shape`, or the preset's."""
        return self.shape if self.shape is not None else get_preset(self.model)

    @property
    def sequence_parallel_on(self) -> bool:
        """Whether the stages run sequence-parallel: asked for (or by default) and tensor-parallel."""
        return self.plan.gpus_per_node > 1 and self.sequence_parallel is not False

    @property
    def boundary_split(self) -> int:
        """Parts each stage-boundary tensor travels in (scatter/gather): the tensor-parallel
        degree, or 1 (off, no tensor parallelism, or already split by sequence parallelism)."""
        on = self.scatter_gather and not self.sequence_parallel_on
        return self.plan.gpus_per_node if on else 1

    @property
    def sharded_optimizer(self) -> bool:
        """Whether the optimizer's moments are sharded (`shard_optimizer` resolved)."""
        return self.shard_optimizer == "on"

    def stage_recompute(self, planned: str) -> str:
        """What a stage whose plan says `planned` recomputes: the forced mode, or `planned`."""
        return planned if self.recompute == "auto" else self.recompute

    @property
    def world_size(self) -> int:
        return len(self.plan.nodes) * self.plan.gpus_per_node

    # ---- files a job writes ---------------------------------------------------------------

    def stage_state_path(self, stage: int) -> Path:
        """Full parameters of one stage of pipeline 0, written by its TP rank 0."""
        return Path(self.run_dir) / "state" / f"stage{stage}.pt"

    @property
    def result_path(self) -> Path:
        """Per-step losses and timings, written by rank 0."""
        return Path(self.run_dir) / "result.json"

    def log_path(self, node: int, local_rank: int) -> Path:
        return Path(self.run_dir) / "logs" / f"node{node}.worker{local_rank}.log"

    # ---- the job file (JSON from the fields, elastic/coordinator/jsonrecord.py) ------------

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(indent=1))

    @classmethod
    def load(cls, path: str | Path) -> JobSpec:
        return cls.from_json(Path(path).read_text())


def shape_of_spec(spec: dict[str, Any]) -> GPTConfig:
    """The model shape of a JobSpec's JSON object (`to_dict`), for readers of the job config that
    read it as plain JSON (`elastic status`, the metrics endpoint)."""
    shape = spec.get("shape")
    return get_preset(spec["model"]) if shape is None else from_data(GPTConfig, shape, where="JobSpec.shape")
