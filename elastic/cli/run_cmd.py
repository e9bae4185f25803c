"""`elastic run`: train a model on simulated nodes of this machine."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic.cli.main import UsageError
from elastic.cli.model_flags import add_shape_flags, model_for_data
from elastic.model.config import PRESETS, GPTConfig, describe_model
from elastic.planning.cluster import (
    DEFAULT_MEMORY_GIB,
    DEFAULT_TFLOPS,
    ClusterSpec,
    cluster_templates,
    initial_plan,
    memory_gib,
)
from elastic.planning.stragglers import POLICIES, StragglerConfig
from templates.plan import Plan, PlanError

if TYPE_CHECKING:
    from elastic.records.job import JobSpec
    from elastic.records.summary import RunSummary


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="train on N simulated nodes x G workers on this machine",
        description="Train a GPT with pipeline replicas (one stage per node) and tensor parallelism "
        "(G workers per node), on local worker processes. Under the control plane, the first Ctrl-C or SIGTERM "
        "finishes the step in flight, writes a checkpoint at that step boundary and exits 130 / 143 naming the "
        "step and the --resume command (`elastic drain --all` from another terminal: exit 3); a second Ctrl-C "
        "stops every process at once.",
    )
    parser.add_argument("--model", default="tiny", help=f"model preset ({', '.join(PRESETS)})")
    add_shape_flags(parser)  # --model-config FILE, --n-layer, --d-model, --n-head, --seq-len, --vocab-size
    parser.add_argument("--nodes", type=int, default=None, help="simulated nodes (default 1, or the plan's)")
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="workers per node = tensor-parallel degree (default 1)",
    )
    parser.add_argument(
        "--fault-tolerance", type=int, default=None, help="f: run at least f+1 pipelines (default 0)"
    )
    parser.add_argument("--global-batch", type=int, default=None, help="samples per step (default 8)")
    parser.add_argument("--microbatch", type=int, default=None, help="samples per microbatch (default 2)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to run")
    parser.add_argument("--plan", type=Path, default=None, help="plan JSON file (instead of the planner's plan)")
    parser.add_argument("--profile", default=None, help="planner profile JSON (default: derived from the preset)")
    parser.add_argument(
        "--device-tflops", type=float, default=DEFAULT_TFLOPS, help="derived profile: achieved TFLOP/s per device"
    )
    parser.add_argument(
        "--device-memory-gib",
        type=float,
        default=None,
        help=f"derived profile: GiB per device (a small value forces multi-stage pipelines; default "
             f"{DEFAULT_MEMORY_GIB:g} on CPU, the GPU's own memory on CUDA)",
    )
    parser.add_argument("--final-state", type=Path, default=None, help="write the full fp32 parameters here")
    parser.add_argument("--summary", type=Path, default=None, help="write the run summary JSON here")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=2, help="linear warmup steps")
    parser.add_argument(
        "--adam-eps",
        type=float,
        default=1e-6,
        help="AdamW epsilon (default 1e-6: see docs/numerics.md, 'Optimizer numerics')",
    )
    parser.add_argument("--seed", type=int, default=0, help="data order seed")
    parser.add_argument("--data", default=None, help="corpus file (default: built-in corpus)")
    parser.add_argument(
        "--run-dir", type=Path, default=None, help="logs and per-worker outputs (default: temp)"
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--timeout", type=float, default=None, help="stop the job after this many seconds")
    parser.add_argument(
        "--static",
        action="store_true",
        help="run without the control plane (no etcd, no agents): any worker's death ends the job. "
        "By default the job runs under the control plane and survives failures live",
    )
    parser.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="KIND:node=N,step=S",
        help="inject a fault (elastic): kill:node=2,step=8 (SIGKILL), hang:node=2,step=8 (SIGSTOP), "
        "kill:node=3,when=reconfig, rejoin:node=2,step=15; repeatable",
    )
    parser.add_argument("--etcd", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                        help="use this etcd: one endpoint or the members of one cluster (default: start one)")
    # -- etcd high availability (ha) --
    parser.add_argument("--etcd-members", type=int, default=1, metavar="N",
                        help="elastic: start a local etcd cluster of N members (odd, 1..7; default 1); not with --etcd")
    parser.add_argument(
        "--checkpoint-every", type=int, default=None, help="elastic: checkpoint every N committed steps (default 5)"
    )
    parser.add_argument("--lease-ttl", type=int, default=3, help="elastic: seconds before a silent node is lost")
    # -- stragglers (elastic/planning/stragglers.py) --
    parser.add_argument("--straggler-policy", choices=POLICIES, default="auto",
                        help="elastic: report marks nodes slower than their peers in status and events; "
                        "rebalance also gives a straggler's pipeline fewer microbatches at the next step "
                        "boundary (and back once it recovers); auto also weighs a hot spare in its stage and "
                        "dropping it, and takes the cheapest estimate; off keeps no speed factors (default auto; "
                        "`elastic stragglers --policy` changes it while the job runs)")
    parser.add_argument("--straggler-threshold", type=float, default=1.25, metavar="X",
                        help="elastic: a node this many times slower than its peers is slow (default 1.25)")
    parser.add_argument("--straggler-steps", type=int, default=10, metavar="K",
                        help="elastic: consecutive slow steps that mark a straggler, fast ones that clear it (default 10)")
    parser.add_argument(
        "--agents",
        choices=("local", "external"),
        default="local",
        help="elastic: start one agent per node here (local), or publish the job and follow it while "
        "agents started elsewhere join it (external: torchrun -m elastic.roles.agent, see deploy/; "
        "needs --etcd, --job and $ELASTIC_JOB_TOKEN)",
    )
    parser.add_argument("--job", default=None, help="elastic: job id (default: a fresh random one)")
    parser.add_argument("--node-cpus", type=float, default=None, metavar="X",
                        help="elastic: cap each local node at X cores with a cgroup CPU quota, so that simulated "
                        "nodes sharing this host run as separate devices (e.g. 0.4 for 4 nodes on 2 cores, which leaves "
                        "0.4 core to etcd and the agents; needs a writable cgroup cpu controller, i.e. root; "
                        "default: no cap)")
    # ---- evaluation on a held-out split (elastic/engine/eval.py) ----
    parser.add_argument("--eval-every", type=int, default=0, metavar="N",
                        help="validation loss on held-out data after every N committed steps and after the last "
                        "(default 0: never; holds out the tail of the corpus from training)")
    parser.add_argument("--eval-batches", type=int, default=None, metavar="K",
                        help="held-out microbatches each evaluation averages over (default 8; needs --eval-every)")
    # ---- --resume (elastic/engine/checkpoint_resume.py) ----
    parser.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="elastic: start from the latest complete checkpoint of an earlier run in RUN_DIR (parameters, "
        "AdamW state, step, LR schedule and data position), at any node count, TP degree or plan; an "
        "incomplete or corrupt newest checkpoint falls back to the one before. --global-batch and --data "
        "default to the earlier run's",
    )
    # ---- --spares (elastic/planning/spares.py) ----
    parser.add_argument("--spares", type=int, default=0, metavar="K",
                        help="elastic: start K hot spare nodes beside the plan's (ids after them): each re-plan "
                        "that drops a lost node takes a spare in, so the job keeps its node count; a node "
                        "that comes back becomes a spare (default 0)")
    parser.set_defaults(func=_run)


def build_plan(args: argparse.Namespace, num_layers: int, *, shape: GPTConfig | None = None) -> Plan:
    """The plan of the run: --plan FILE, or the planner's fastest plan with at least f+1 pipelines
    (for the model `shape`; None: the --model preset's)."""
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
        return plan
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
        )
        return initial_plan(spec, cluster_templates(spec))
    except ValueError as exc:  # bad flags, a malformed profile, or no feasible plan
        raise UsageError(str(exc)) from None


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


def _unwind_on_sigterm() -> None:
    """SIGTERM (a scheduler, `timeout`, `kill`) unwinds like Ctrl-C, so the launcher's cleanup
    stops every process it started (by default SIGTERM would end this process and orphan them)."""

    def handler(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        print("elastic run: terminated (SIGTERM); stopping every process of the job", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def _run(args: argparse.Namespace) -> int:
    zygote = _start_warm_parent(args)
    try:
        return _run_job(args)
    finally:
        if zygote is not None:
            zygote.close()


def _start_warm_parent(args: argparse.Namespace) -> Any:
    """The warm parent of the job's local agents and workers (elastic/roles/zygote.py), started
    before anything else: its `import torch` runs while this process plans and starts etcd (this
    process never imports torch before the job ends). The launcher finds it in $ELASTIC_ZYGOTE."""
    from elastic.roles.zygote import ZYGOTE_ENV, Zygote, warm_enabled

    if args.static or args.agents != "local" or not warm_enabled() or os.environ.get(ZYGOTE_ENV):
        return None
    zygote = Zygote()
    os.environ[ZYGOTE_ENV] = zygote.path
    return zygote


def _run_job(args: argparse.Namespace) -> int:
    _unwind_on_sigterm()
    # torch and the runtime load here, not at import, so that `elastic --help` and the planner
    # commands start without torch.
    from elastic.cli.run_guard import guard_run
    from elastic.cli.run_stop import report_stop_timed_out, report_stopped, stop_on_signals
    from elastic.coordinator.client import EtcdAccessError, EtcdUnreachableError
    from elastic.roles.job_stop import JobStopped, StopTimedOut
    from elastic.roles.launcher import JobFailed, StartupError, WorkerFailed, launch, launch_elastic

    cfg = model_for_data(args)  # preset + --model-config + --n-layer ...; prepared --data: its vocabulary
    token = _check_flags(args)
    _check_spares(args)
    _resume_defaults(args)
    plan = build_plan(args, cfg.num_layers, shape=cfg)
    try:
        cfg.check_tensor_parallel(plan.gpus_per_node, by=f"{plan.gpus_per_node} gpus per node")
    except ValueError as exc:
        raise UsageError(f"model {args.model}'s {exc}") from None
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="elastic-run-"))
    spec = _job_spec(args, plan, run_dir, shape=cfg)
    _check_held_out(spec)
    guard = guard_run(run_dir, embedded_etcd=args.etcd is None and not args.static,  # run dir in use: exit 2
                      local_agents=not args.static and args.agents == "local")
    shape = " + ".join(f"{len(p.stages)}-stage x {p.microbatches} mb" for p in plan.pipelines)
    print(
        f"elastic run: {describe_model(args.model, cfg)}, {len(plan.nodes)} nodes x {plan.gpus_per_node} workers, pipelines: {shape}, "
        f"global batch {plan.global_batch}, run dir {run_dir}",
        flush=True,
    )
    elastic = not args.static
    job_stop = None
    try:
        if elastic:
            config = _elastic_config(args, spec, plan)
            config = _resume_config(args, config)
            config = _spares_config(args, config)
            job_stop = stop_on_signals(config)  # the first Ctrl-C or SIGTERM stops at a step boundary and saves
            summary = launch_elastic(config, etcd_endpoint=args.etcd, timeout_s=args.timeout, job=args.job,
                                     token=token, local_agents=args.agents == "local", job_stop=job_stop,
                                     etcd_members=args.etcd_members, before_etcd_stops=guard.record_history,
                                     node_cpus=args.node_cpus)
        else:
            summary = launch(spec, timeout_s=args.timeout)
    except JobStopped as stopped:  # on request (a signal, `elastic drain --all`), with a checkpoint
        return report_stopped(args, stopped, run_dir)
    except StopTimedOut as exc:
        return report_stop_timed_out(args, exc, job_stop, run_dir)
    except (WorkerFailed, JobFailed, TimeoutError) as exc:
        print(f"elastic run: error: {exc}", file=sys.stderr)
        return 1
    except (EtcdAccessError, EtcdUnreachableError, StartupError) as exc:  # no start (credentials, no answer): one line
        raise UsageError(str(exc)) from None
    _write_outputs(args, spec, summary, run_dir, elastic=elastic)
    return 0


def _check_flags(args: argparse.Namespace) -> str | None:
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
    if args.node_cpus is not None and (args.static or args.agents == "external" or not args.node_cpus > 0):
        raise UsageError(f"--node-cpus caps the local agents of an elastic run: it must be > 0 (got {args.node_cpus}) "
                         "and cannot go with --static or --agents external")
    return token


def _check_etcd_flags(args: argparse.Namespace) -> None:
    """`--etcd` is a valid endpoint list; `--etcd-members` is odd, in range, and not with `--etcd`
    or `--static` (UsageError)."""
    from elastic.coordinator.client import parse_endpoints
    from elastic.coordinator.etcd_server import check_member_count

    try:
        if args.etcd is not None:
            parse_endpoints(args.etcd)
        check_member_count(args.etcd_members)
    except ValueError as exc:
        raise UsageError(f"--etcd/--etcd-members: {exc}") from None
    if args.etcd_members != 1 and (args.etcd is not None or args.static):
        raise UsageError("--etcd-members starts a local etcd cluster: it cannot go with --etcd or --static")


def _job_spec(args: argparse.Namespace, plan: Plan, run_dir: Path, *, shape: GPTConfig | None = None) -> JobSpec:
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
            plan=plan,
            steps=args.steps,
            run_dir=str(run_dir),
            data_seed=args.seed,
            data_path=args.data,
            optim=optim,
            device=args.device,
            eval_every=args.eval_every,
            eval_batches=_eval_batches(args),
            shape=shape,
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


def _check_held_out(spec: JobSpec) -> None:
    """With --eval-every, the corpus must hold both a training part and a held-out tail (UsageError)."""
    if spec.eval_every == 0:
        return
    from elastic.data.dataset import TokenDataset

    try:
        TokenDataset(seq_len=spec.model_config.seq_len, seed=spec.data_seed, path=spec.data_path, held_out=True)
    except (ValueError, OSError) as exc:
        raise UsageError(f"--eval-every: {exc}") from None


def _write_outputs(
    args: argparse.Namespace, spec: JobSpec, summary: RunSummary, run_dir: Path, *, elastic: bool
) -> None:
    """Print the run's result lines, then write what the flags ask for (final state, summary)
    and the run directory's summary and report."""
    print(
        f"elastic run: {summary.steps_committed} steps committed, final loss "
        f"{summary.losses[-1] if summary.losses else float('nan'):.4f}, {summary.tokens_per_s:.0f} tokens/s",
        flush=True,
    )
    if summary.recoveries or elastic:
        print(
            f"elastic run: {len(summary.recoveries)} recoveries, worker restarts {summary.worker_restarts}",
            flush=True,
        )
    if args.final_state is not None:  # torch only here: its import alone costs a second at exit
        import torch

        from elastic.records.summary import load_final_state

        torch.save(load_final_state(spec), args.final_state)
    summary_json = json.dumps(summary.to_dict(), indent=1)
    (run_dir / "summary.json").write_text(summary_json)
    if args.summary is not None:
        args.summary.write_text(summary_json)
    _write_report(run_dir)


def _write_report(run_dir: Path) -> None:
    """The run report (elastic/ops/report.py): a PNG timeline; a failure here is only a warning."""
    from elastic.ops.report import ReportError, write_report

    try:
        print(f"elastic run: report {write_report(run_dir)}", flush=True)
    except (ReportError, OSError, ValueError, ImportError) as exc:  # ImportError: no matplotlib here
        print(f"elastic run: warning: no report: {exc}", file=sys.stderr)


def _elastic_config(args: argparse.Namespace, spec: Any, plan: Plan) -> Any:
    """The control plane's view of the run: planner inputs for re-planning, injections, checkpoints."""
    from elastic.records.config import ElasticConfig
    from elastic.records.injection import check_injections, parse_injection

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
        )
        stragglers = StragglerConfig(policy=args.straggler_policy, threshold=args.straggler_threshold,
                                     steps=args.straggler_steps)
        return ElasticConfig(
            spec=spec, cluster=cluster, injections=tuple(injections), checkpoint_every=every,
            lease_ttl=args.lease_ttl, stragglers=stragglers,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


# ---- --resume ----------------------------------------------------------------------------


def _resume_manifest(args: argparse.Namespace) -> Any:
    """The manifest of the run to resume (None when it has none); UsageError if unreadable."""
    from elastic.coordinator.jsonrecord import RecordError
    from elastic.records.resume import CheckpointManifest

    try:
        return CheckpointManifest.load(args.resume / "checkpoints")
    except (RecordError, OSError) as exc:
        raise UsageError(f"--resume {args.resume}: unreadable checkpoint manifest: {exc}") from None


def _resume_defaults(args: argparse.Namespace) -> None:
    """With --resume: check the flags that go with it, and take --global-batch and --data from the
    earlier run when they are not given (they fix the samples of every step)."""
    if args.resume is None:
        return
    if args.static:
        raise UsageError("--resume needs the control plane: it cannot take --static")
    if not args.resume.is_dir():
        raise UsageError(f"--resume {args.resume}: no such run directory")
    manifest = _resume_manifest(args)
    if manifest is not None:
        if args.global_batch is None and args.plan is None:
            args.global_batch = manifest.global_batch
        if args.data is None:
            args.data = manifest.data_path


def _resume_config(args: argparse.Namespace, config: Any) -> Any:
    """`config` with the checkpoint to resume from (--resume), after checking it continues the
    earlier run exactly; UsageError (exit 2) for a missing, corrupt or incomplete checkpoint, or
    one of another model shape, batch or data."""
    if args.resume is None:
        return config
    import dataclasses

    from elastic.engine.checkpoint_resume import CheckpointError, find_resume_point
    from elastic.records.resume import CheckpointManifest, compare_runs

    spec = config.spec
    try:
        source = find_resume_point(args.resume, spec.model_config)
    except CheckpointError as exc:
        raise UsageError(f"--resume {args.resume}: {exc}") from None
    earlier = _resume_manifest(args)
    if earlier is not None:
        ours = CheckpointManifest(model=spec.model, model_config=spec.model_config,
                                  global_batch=spec.plan.global_batch, data_seed=spec.data_seed,
                                  data_path=spec.data_path, optim=spec.optim)
        refusals, notes = compare_runs(earlier, ours)
        if refusals:
            raise UsageError(f"--resume {args.resume}: {refusals[0]}")
        for note in notes:
            print(f"elastic run: note: {note}", file=sys.stderr, flush=True)
    if source.step >= spec.steps:
        raise UsageError(f"--resume {args.resume}: its checkpoint is at step {source.step}; --steps {spec.steps} "
                         "leaves nothing to run")
    for skipped in source.skipped:
        print(f"elastic run: warning: the checkpoint of step {skipped.step} of {args.resume} cannot be used "
              f"({skipped.why}); falling back to the one before", file=sys.stderr, flush=True)
    return dataclasses.replace(config, resume=source)


# ---- --spares ----------------------------------------------------------------------------


def _check_spares(args: argparse.Namespace) -> None:
    """--spares: a count >= 0, and only under the control plane (UsageError otherwise)."""
    if args.spares < 0:
        raise UsageError(f"--spares must be >= 0, got {args.spares}")
    if args.spares and args.static:
        raise UsageError("--static runs without the control plane: it cannot take --spares")


def _spares_config(args: argparse.Namespace, config: Any) -> Any:
    """`config` with `--spares` (ElasticConfig.spares)."""
    import dataclasses

    return dataclasses.replace(config, spares=args.spares) if args.spares else config
