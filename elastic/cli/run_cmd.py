"""`elastic run`: train a model on simulated nodes of this machine.

This file holds the command's flags (`register`), the driving of one job (warm parent, checks,
plan, launch under the control plane or --static, the ways a run stops) and its result lines and
outputs. Turning the flags into a plan, a JobSpec and the control plane's config is run_config.py;
--resume is run_resume.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic.cli.main import UsageError
from elastic.cli.model_flags import (
    add_recompute_flag,
    add_schedule_flag,
    add_shape_flags,
    add_shard_optimizer_flag,
    check_init_from,
    model_for_data,
)
from elastic.cli.run_config import (
    build_plan,
    check_flags,
    check_held_out,
    check_spares,
    elastic_config,
    job_spec,
    rejoin_fenced,
    spares_config,
)
from elastic.cli.run_resume import resume_config, resume_defaults
from elastic.model.config import PRESETS, RECOMPUTE_MODES, describe_model
from elastic.planning.cluster import DEFAULT_MEMORY_GIB, DEFAULT_TFLOPS
from elastic.planning.stragglers import POLICIES

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
    parser.add_argument("--report", action=argparse.BooleanOptionalAction, default=True,
                        help="draw the run report, RUN_DIR/report.png, at the end (default: on; matplotlib takes "
                        "about 2 s; `elastic report RUN_DIR` draws it later)")
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
        "--init-from", type=Path, default=None, metavar="DIR",
        help="start from a Hugging Face checkpoint (config.json + model.safetensors, sharded or not) of a "
        "GPT2LMHeadModel or LlamaForCausalLM: its config sets the model's shape (before --model-config and the "
        "shape flags), every worker reads only its own shards; DIR must be readable on every node",
    )
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
    parser.add_argument("--rejoin-fenced", type=int, default=None, metavar="N",
                        help="elastic: start a local node that the job fenced out while it lived (a partition "
                        "that healed, a stall past the leader's probe) again as its next incarnation, up to N times "
                        "a node; it joins at a step boundary like a new node (default 1 with local agents; "
                        "0: it stays out)")
    # ---- activation recomputation (elastic/model/gpt.py) ----
    add_recompute_flag(parser)
    add_schedule_flag(parser)
    parser.add_argument("--scatter-gather", action=argparse.BooleanOptionalAction, default=True,
                        help="with --gpus-per-node > 1, each tensor-parallel rank sends 1/t of every activation and "
                        "gradient between stages and the receiving node all-gathers it (default: on; bit-identical; "
                        "under sequence parallelism the boundary is already split)")
    parser.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                        help="split the activations between the tensor-parallel regions (LayerNorms, residual, "
                        "dropout) along the sequence, and what crosses between stages with them (default: on with "
                        "--gpus-per-node > 1); the same function, summed in another order (within 1e-5)")
    add_shard_optimizer_flag(parser)
    # ---- evaluation on a held-out split (elastic/engine/eval.py) ----
    parser.add_argument("--eval-every", type=int, default=0, metavar="N",
                        help="validation loss on held-out data after every N committed steps and after the last "
                        "(default 0: never; holds out the tail of the corpus from training)")
    parser.add_argument("--eval-batches", type=int, default=None, metavar="K",
                        help="held-out microbatches each evaluation averages over (default 8; needs --eval-every)")
    # ---- --resume (elastic/engine/checkpoint/resume.py) ----
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


def _unwind_on_sigterm() -> None:
    """SIGTERM (a scheduler, `timeout`, `kill`) unwinds like Ctrl-C, so the launcher's cleanup
    stops every process it started (by default SIGTERM would end this process and orphan them)."""

    def handler(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        print("elastic run: terminated (SIGTERM); stopping every process of the job", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def _recomputing(spec: JobSpec) -> str:
    """", recomputing full on 2 of 4 stages" when some stage recomputes (the plan's choice or
    the forced mode), ", sequence-parallel" when the stages are, ", interleaved v=2" when a
    pipeline runs chunks, ", scatter/gather" when boundaries travel in parts; else nothing."""
    stages = [spec.stage_recompute(st.recompute) for pipe in spec.plan.pipelines for st in pipe.stages]
    modes = [f"{mode} on {stages.count(mode)} of {len(stages)} stages" for mode in RECOMPUTE_MODES[1:] if mode in stages]
    sp = ", sequence-parallel" if spec.sequence_parallel_on else ""
    vs = sorted({p.virtual_stages for p in spec.plan.pipelines if p.virtual_stages > 1})
    interleaved = f", interleaved v={'/'.join(map(str, vs))}" if vs else ""
    deep = any(len(p.stages) > 1 for p in spec.plan.pipelines)
    split = ", scatter/gather" if spec.boundary_split > 1 and deep else ""
    sharded = ", optimizer sharded" if spec.sharded_optimizer else ""
    return (f", recomputing {' and '.join(modes)}" if modes else "") + sp + interleaved + split + sharded


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
    from elastic.roles.zygote import ZYGOTE_ENV, warm_enabled
    from elastic.roles.zygote_client import Zygote

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
    from elastic.coordinator.credentials import EtcdAccessError, EtcdUnreachableError
    from elastic.roles.interrupt import Interrupt, Interrupted
    from elastic.roles.job_stop import JobStopped, StopTimedOut
    from elastic.roles.launch_errors import JobFailed, StartupError, WorkerFailed
    from elastic.roles.launcher import launch_elastic
    from elastic.roles.static_launcher import launch

    cfg = model_for_data(args)  # preset + --init-from + --model-config + --n-layer ...; prepared --data: its vocabulary
    check_init_from(args, cfg)
    token = check_flags(args)
    check_spares(args)
    resume_defaults(args)
    planned = build_plan(args, shape=cfg)
    plan = planned.plan
    try:
        cfg.check_tensor_parallel(plan.gpus_per_node, by=f"{plan.gpus_per_node} gpus per node")
    except ValueError as exc:
        raise UsageError(f"model {args.model}'s {exc}") from None
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="elastic-run-"))
    spec = job_spec(args, planned, run_dir, shape=cfg)
    check_held_out(spec)
    guard = guard_run(run_dir, embedded_etcd=args.etcd is None and not args.static,  # run dir in use: exit 2
                      local_agents=not args.static and args.agents == "local")
    shape = " + ".join(f"{len(p.stages)}-stage x {p.microbatches} mb" for p in plan.pipelines) + _recomputing(spec)
    print(
        f"elastic run: {describe_model(args.model, cfg)}, {len(plan.nodes)} nodes x {plan.gpus_per_node} workers, pipelines: {shape}, "
        f"global batch {plan.global_batch}, run dir {run_dir}" + (f", weights from {spec.init_from}" if spec.init_from else ""),
        flush=True,
    )
    elastic = not args.static
    job_stop = None
    interrupt = Interrupt()
    try:
        if elastic:
            config = elastic_config(args, spec, planned)
            config = resume_config(args, config)
            config = spares_config(args, config)
            job_stop = stop_on_signals(config, interrupt)  # the first Ctrl-C or SIGTERM stops at a step boundary and saves
            summary = launch_elastic(config, etcd_endpoint=args.etcd, timeout_s=args.timeout, job=args.job,
                                     token=token, local_agents=args.agents == "local", job_stop=job_stop,
                                     etcd_members=args.etcd_members, before_etcd_stops=guard.record_history,
                                     node_cpus=args.node_cpus, rejoin_fenced=rejoin_fenced(args),
                                     interrupt=interrupt)
        else:
            summary = launch(spec, timeout_s=args.timeout)
    except Interrupted as exc:  # a signal asked to stop at once: every process is stopped by now
        raise exc.unwound() from None
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
    if args.report:
        _write_report(run_dir)


def _write_report(run_dir: Path) -> None:
    """The run report (elastic/ops/report.py): a PNG timeline; a failure here is only a warning."""
    from elastic.ops.report import ReportError, write_report

    try:
        print(f"elastic run: report {write_report(run_dir)}", flush=True)
    except (ReportError, OSError, ValueError, ImportError) as exc:  # ImportError: no matplotlib here
        print(f"elastic run: warning: no report: {exc}", file=sys.stderr)
