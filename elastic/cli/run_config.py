"""`elastic run`'s flags turned into what runs: the plan (--plan FILE or the planner's), the
device type and memory the planner counts with, the checks of flags that go together, the
JobSpec and the control plane's ElasticConfig (injections, checkpoints, leases, stragglers,
--spares). Every bad value is a UsageError (exit 2)."""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic.cli.main import UsageError
from elastic.model.config import GPTConfig
from elastic.planning.cluster import ClusterSpec, memory_gib
from elastic.planning.optimizer_choice import choose_plan
from elastic.planning.stragglers import StragglerConfig
from templates.plan import Plan, PlanError

if TYPE_CHECKING:
    from elastic.records.job import JobSpec


@dataclass(frozen=True, kw_only=True)
class PlannedRun:
    """What the planner decided for the run, beyond the plan: the job and the leader's re-plans
    read it (the JobSpec's optimizer, the elastic config's ClusterSpec)."""

    plan: Plan
    shard_optimizer: str
    """"on" or "off": `--shard-optimizer auto` resolved (on where the planner chose it; with
    --plan FILE, off)."""
    moment_slices: int = 1
    """The slices the plan's memory was counted with (`ClusterSpec.moment_slices`): the leader's
    re-plans keep them. 1 for an unsharded plan and for --plan FILE (the bound for any S)."""
    memory_margin_bytes: int = 0
    """Bytes held back on every worker to make the plan fit (`ClusterSpec.memory_margin_bytes`)."""


def build_plan(args: argparse.Namespace, *, shape: GPTConfig | None = None) -> PlannedRun:
    """The plan of the run: --plan FILE, or the planner's fastest plan with at least f+1 pipelines
    (for the model `shape`; None: the --model preset's), with the optimizer sharded or not as
    `--shard-optimizer` says."""
    if args.plan is not None:
        try:
            plan = Plan.from_json(args.plan.read_text())
        except OSError as exc:
            raise UsageError(f"cannot read --plan {args.plan}: {exc.strerror}") from None
        except PlanError as exc:
            raise UsageError(f"--plan {args.plan}: {exc}") from None
        checks = {
            "nodes": (args.nodes, len(plan.nodes)),
            "gpus-per-node": (args.gpus_per_node, plan.gpus_per_node),
            "microbatch": (args.microbatch, plan.microbatch_size),
            "global-batch": (args.global_batch, plan.global_batch),
        }
        for flag, (given, planned) in checks.items():
            if given is not None and given != planned:
                raise UsageError(f"--{flag} {given} disagrees with the plan's {planned}")
        if args.fault_tolerance is not None and len(plan.pipelines) < args.fault_tolerance + 1:
            raise UsageError(
                f"the plan has {len(plan.pipelines)} pipelines; --fault-tolerance {args.fault_tolerance} needs "
                f"{args.fault_tolerance + 1}"
            )
        # A given plan: the planner chose nothing (auto is off), counted with whole moments.
        return PlannedRun(plan=plan, shard_optimizer="on" if args.shard_optimizer == "on" else "off")
    try:
        spec = ClusterSpec(
            model=args.model,
            nodes=1 if args.nodes is None else args.nodes,
            gpus_per_node=1 if args.gpus_per_node is None else args.gpus_per_node,
            fault_tolerance=0 if args.fault_tolerance is None else args.fault_tolerance,
            global_batch=8 if args.global_batch is None else args.global_batch,
            microbatch=2 if args.microbatch is None else args.microbatch,
            profile_path=args.profile,
            device_tflops=args.device_tflops,
            device_memory_gib=_memory_gib(args),
            device_type=_device_type(args),
            shape=shape,
            recompute=args.recompute,
            virtual_stages=args.virtual_stages,
        )
        chosen = choose_plan(spec, args.shard_optimizer)
    except ValueError as exc:  # bad flags, a malformed profile, or no feasible plan
        raise UsageError(str(exc)) from None
    if not chosen.fits:
        print("elastic run: warning: the plan's largest worker exceeds the device by the memory model (an uneven "
              "batch split that no plan holding memory back avoids; `elastic plan` shows it)", file=sys.stderr)
    return PlannedRun(plan=chosen.plan, shard_optimizer="on" if chosen.sharded else "off",
                      moment_slices=chosen.counted_slices if chosen.sharded else 1,
                      memory_margin_bytes=chosen.margin_bytes)


def _device_type(args: argparse.Namespace) -> str:
    """The device type the workers will compute on (what the planner counts activations in):
    --device, or for "auto" whether this machine has a GPU (torch loads only where one may be)."""
    if args.device != "auto":
        return str(args.device)
    if not (shutil.which("nvidia-smi") or Path("/dev/nvidiactl").exists()):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _memory_gib(args: argparse.Namespace) -> float:
    """--device-memory-gib, or the device's (`planning.cluster.memory_gib`)."""
    return memory_gib(args.device_memory_gib, _device_type(args), profile=args.profile)


def check_flags(args: argparse.Namespace) -> str | None:
    """Check the flags that go together (UsageError); the job token of `--agents external`
    ($ELASTIC_JOB_TOKEN), else None."""
    if args.steps < 0:
        raise UsageError(f"--steps must be >= 0, got {args.steps}")
    if args.static and (args.inject or args.etcd is not None or args.checkpoint_every is not None):
        raise UsageError("--static runs without the control plane: it cannot take --inject, --etcd or --checkpoint-every")
    _check_etcd_flags(args)
    token = None
    if args.agents == "external":
        import os

        token = os.environ.get("ELASTIC_JOB_TOKEN") or None
        if args.static or args.etcd is None or args.job is None or token is None:
            raise UsageError("--agents external needs --etcd, --job and $ELASTIC_JOB_TOKEN, and not --static")
    if args.rejoin_fenced is not None and (
            args.rejoin_fenced < 0 or (args.rejoin_fenced and (args.static or args.agents == "external"))):
        raise UsageError(f"--rejoin-fenced starts local nodes again: it must be >= 0 (got {args.rejoin_fenced}) and "
                         "cannot go with --static or --agents external")
    if args.node_cpus is not None and (args.static or args.agents == "external" or not args.node_cpus > 0):
        raise UsageError(f"--node-cpus caps the local agents of an elastic run: it must be > 0 (got {args.node_cpus}) "
                         "and cannot go with --static or --agents external")
    return token


def rejoin_fenced(args: argparse.Namespace) -> int:
    """How many times a local node fenced while it lived is started again: `--rejoin-fenced N`, or 1
    where the launcher starts the nodes (a fenced node that lives is healthy capacity: a healed
    partition, a stall past the leader's probe), 0 where it does not (--static, --agents external)."""
    if args.rejoin_fenced is not None:
        return int(args.rejoin_fenced)
    return 0 if args.static or args.agents == "external" else 1


def _check_etcd_flags(args: argparse.Namespace) -> None:
    """`--etcd` is a valid endpoint list; `--etcd-members` is odd, in range, and not with `--etcd`
    or `--static` (UsageError)."""
    from elastic.coordinator.client import parse_endpoints
    from elastic.coordinator.etcd_cluster import check_member_count

    try:
        if args.etcd is not None:
            parse_endpoints(args.etcd)
        check_member_count(args.etcd_members)
    except ValueError as exc:
        raise UsageError(f"--etcd/--etcd-members: {exc}") from None
    if args.etcd_members != 1 and (args.etcd is not None or args.static):
        raise UsageError("--etcd-members starts a local etcd cluster: it cannot go with --etcd or --static")


def job_spec(args: argparse.Namespace, planned: PlannedRun, run_dir: Path, *, shape: GPTConfig | None = None
             ) -> JobSpec:
    """The JobSpec of the run (model shape, optimizer, data and device from the flags); UsageError
    if invalid."""
    from elastic.records.job import JobSpec
    from elastic.records.optim_config import OptimConfig

    try:
        optim = OptimConfig(
            lr=args.lr, min_lr=min(1e-4, args.lr), warmup_steps=args.warmup_steps, eps=args.adam_eps
        )
        return JobSpec(
            model=args.model,
            plan=planned.plan,
            steps=args.steps,
            run_dir=str(run_dir),
            data_seed=args.seed,
            data_path=args.data,
            optim=optim,
            device=args.device,
            eval_every=args.eval_every,
            eval_batches=_eval_batches(args),
            shape=shape,
            recompute=args.recompute,
            sequence_parallel=args.sequence_parallel,
            scatter_gather=args.scatter_gather,
            shard_optimizer=planned.shard_optimizer,
            init_from=None if getattr(args, "init_from", None) is None else str(Path(args.init_from).resolve()),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _eval_batches(args: argparse.Namespace) -> int:
    """--eval-batches (default 8), checked with --eval-every (UsageError if they do not go together)."""
    if args.eval_every < 0:
        raise UsageError(f"--eval-every must be >= 0, got {args.eval_every}")
    if args.eval_batches is None:
        return 8
    if args.eval_every == 0:
        raise UsageError("--eval-batches needs --eval-every N (N > 0)")
    if args.eval_batches < 1:
        raise UsageError(f"--eval-batches must be >= 1, got {args.eval_batches}")
    return int(args.eval_batches)


def check_held_out(spec: JobSpec) -> None:
    """With --eval-every, the corpus must hold both a training part and a held-out tail (UsageError)."""
    if spec.eval_every == 0:
        return
    from elastic.data.dataset import TokenDataset

    try:
        TokenDataset(seq_len=spec.model_config.seq_len, seed=spec.data_seed, path=spec.data_path, held_out=True)
    except (ValueError, OSError) as exc:
        raise UsageError(f"--eval-every: {exc}") from None


def elastic_config(args: argparse.Namespace, spec: Any, planned: PlannedRun) -> Any:
    """The control plane's view of the run: planner inputs for re-planning, injections, checkpoints."""
    from elastic.records.config import ElasticConfig
    from elastic.records.injection import check_injections, parse_injection

    plan = planned.plan

    try:
        injections = [parse_injection(text) for text in args.inject]
        check_injections(injections, nodes=max(plan.nodes) + 1, steps=args.steps)
        every = 5 if args.checkpoint_every is None else args.checkpoint_every
        if every < 0:
            raise ValueError(f"--checkpoint-every must be >= 0, got {every}")
        if args.lease_ttl < 2:
            raise ValueError(f"--lease-ttl must be >= 2 (etcd's minimum), got {args.lease_ttl}")
        cluster = ClusterSpec(
            model=args.model,
            nodes=len(plan.nodes),
            gpus_per_node=plan.gpus_per_node,
            fault_tolerance=plan.fault_tolerance,
            global_batch=plan.global_batch,
            microbatch=plan.microbatch_size,
            profile_path=args.profile,
            device_tflops=args.device_tflops,
            device_memory_gib=_memory_gib(args),
            device_type=_device_type(args),
            shape=spec.model_config,
            recompute=spec.recompute,
            virtual_stages=args.virtual_stages,
            moment_slices=planned.moment_slices,
            memory_margin_bytes=planned.memory_margin_bytes,
        )
        stragglers = StragglerConfig(policy=args.straggler_policy, threshold=args.straggler_threshold,
                                     steps=args.straggler_steps)
        return ElasticConfig(
            spec=spec, cluster=cluster, injections=tuple(injections), checkpoint_every=every,
            lease_ttl=args.lease_ttl, stragglers=stragglers,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def check_spares(args: argparse.Namespace) -> None:
    """--spares: a count >= 0, and only under the control plane (UsageError otherwise)."""
    if args.spares < 0:
        raise UsageError(f"--spares must be >= 0, got {args.spares}")
    if args.spares and args.static:
        raise UsageError("--static runs without the control plane: it cannot take --spares")


def spares_config(args: argparse.Namespace, config: Any) -> Any:
    """`config` with `--spares` (ElasticConfig.spares)."""
    import dataclasses

    return dataclasses.replace(config, spares=args.spares) if args.spares else config
