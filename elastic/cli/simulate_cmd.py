"""`elastic simulate`: effective training time of this runtime and three baselines under a failure
(and straggler) trace.

A discrete-event replay on a cluster described by flags (no processes are started): the real
planner gives every plan and its iteration time; recovery costs are the stated `RecoveryCosts`.
See elastic/sim/ for each policy's assumptions; the output repeats them.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from elastic.cli.main import UsageError
from elastic.cli.model_flags import add_recompute_flag, add_schedule_flag, add_shape_flags, model_from_flags
from elastic.model.config import PRESETS
from elastic.planning.cluster import DEFAULT_MEMORY_GIB, DEFAULT_NETWORK_GBPS, DEFAULT_TFLOPS, ClusterSpec
from elastic.sim.config import RecoveryCosts
from elastic.sim.report import format_table
from elastic.sim.simulate import POLICIES, simulate
from elastic.sim.slowness import STRAGGLER_POLICIES
from elastic.sim.trace import parse_duration
from elastic.sim.trace_arg import trace_from_arg


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="replay a failure trace on a large cluster: this runtime vs checkpoint-restart, redundancy and rerouting",
        description="Simulate effective training time under a failure trace with the real planner and its "
        "cost model, for the elastic (this runtime: partial replay, measured detection, rebuild and transfer, "
        "spares), checkpoint-restart (Varuna-like), redundant (Bamboo-like) and recycle (ReCycle-like: a failed "
        "stage's microbatches rerouted to its peers) policies. `--trace llama3` draws failures at Llama 3's rate "
        "and causes (Dubey et al. 2024, Table 5), scaled to the cluster's GPUs. Every assumption is printed with "
        "the results, with the source of each measured figure.",
    )
    parser.add_argument("--model", required=True, help=f"model preset ({', '.join(PRESETS)})")
    add_shape_flags(parser)
    parser.add_argument("--nodes", type=int, required=True, help="N: nodes at time 0")
    parser.add_argument(
        "--trace", required=True,
        help="llama3[,seed=S][,repair=24h][,restart=2m] (Llama 3's 419 unexpected interruptions per 54 days per "
        "16,384 GPUs, scaled to N x G GPUs, causes drawn by Table 5's counts: a hardware cause loses the node "
        "until `repair`, a software one its processes until `restart`); or every=T,min=N[,rejoin=R][,seed=S]"
        "[,start=T0] (one node lost every T down to N) and/or slow_every=D[,slow_for=30m][,slow_factor=2] (one "
        "node slowed every D); or a JSON file of [{time_s, event: fail|join|recover, node[, cause]}, "
        "{time_s, event: slow, node, factor}]",
    )
    parser.add_argument("--hours", type=float, required=True, help="simulated time")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated subset of {POLICIES}")
    parser.add_argument("--json", action="store_true", help="print the JSON report instead of a table")
    job = parser.add_argument_group("job and cluster")
    job.add_argument("--gpus-per-node", type=int, default=1, help="G: devices per node (TP degree)")
    job.add_argument("--fault-tolerance", type=int, default=1, help="f: elastic keeps at least f+1 pipelines")
    job.add_argument("--global-batch", type=int, default=512, help="samples per optimizer step")
    job.add_argument("--microbatch", type=int, default=1, help="samples per microbatch")
    job.add_argument("--profile", default=None, help="measured profile JSON (default: derived from the preset)")
    job.add_argument("--device-tflops", type=float, default=DEFAULT_TFLOPS, help="derived: TFLOP/s per device")
    job.add_argument("--device-memory-gib", type=float, default=DEFAULT_MEMORY_GIB, help="derived: GiB per device")
    job.add_argument("--spares", type=int, default=0, metavar="K",
                     help="elastic: K hot spare nodes beside the N (a failure takes one in, at the cost of a shard "
                     "fetch, instead of running degraded; a returning node becomes one)")
    job.add_argument("--straggler-policy", choices=STRAGGLER_POLICIES, default="rebalance",
                     help="elastic: what to do about a slow node: off (nothing), rebalance (re-split the microbatches, "
                     "as `elastic run --straggler-policy rebalance`), auto (also swap it for a free spare); with slow "
                     "nodes in the trace the table also shows 'elastic (stragglers off)'")
    add_recompute_flag(job)
    add_schedule_flag(job)
    job.add_argument("--network-gbps", type=float, default=DEFAULT_NETWORK_GBPS, help="per-node NIC bandwidth, Gbit/s")
    rec = parser.add_argument_group("recovery costs")
    defaults = RecoveryCosts()
    rec.add_argument("--detect-s", type=float, default=defaults.detect_s,
                     help="detection of a lost host (lease TTL; bench/README.md 'Failure detection')")
    rec.add_argument("--detect-process-s", type=float, default=defaults.detect_process_s,
                     help="detection when only a node's processes die (node monitor, measured 5.3 ms)")
    rec.add_argument("--rebuild-s", type=float, default=defaults.rebuild_s,
                     help="group/stage rebuild (measured: bench/README.md 'Recovery that loses less than a step')")
    rec.add_argument("--transfer-gbps", type=float, default=defaults.transfer_gbps,
                     help="shard transfer rate per node, capped by --network-gbps (measured, same section)")
    rec.add_argument("--whole-step-replay", action="store_true",
                     help="elastic: replay the whole interrupted step (no partial replay)")
    rec.add_argument("--recycle-hidden", type=float, default=defaults.recycle_hidden,
                     help="recycle: share of the rerouted work hidden in pipeline bubbles (0..1, at most the bubbles)")
    rec.add_argument("--replan-s", type=float, default=None, help="fixed planning time (default: measured)")
    rec.add_argument("--process-start-s", type=float, default=defaults.process_start_s, help="restart: relaunch")
    rec.add_argument("--storage-gbps", type=float, default=defaults.storage_gbps, help="checkpoint storage Gbit/s")
    rec.add_argument("--checkpoint-interval", default=None, help="seconds (or 10m) between checkpoints (default: Young)")
    rec.add_argument("--straggler-detect-steps", type=int, default=defaults.straggler_detect_steps,
                     help="steps from a slowdown (or recovery) to the runtime's mark (or its clearing)")
    rec.add_argument(
        "--redundant-forward", type=float, default=defaults.redundant_forward,
        help="share of the redundant forward not hidden in bubbles (0..1)",
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    cfg = model_from_flags(args)
    try:
        if not args.hours > 0:
            raise ValueError(f"--hours must be > 0, got {args.hours}")
        horizon = args.hours * 3600.0
        policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
        cluster = ClusterSpec(
            model=args.model,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            fault_tolerance=args.fault_tolerance,
            global_batch=args.global_batch,
            microbatch=args.microbatch,
            device_tflops=args.device_tflops,
            device_memory_gib=args.device_memory_gib,
            network_gbps=args.network_gbps,
            profile_path=args.profile,
            shape=cfg,
            recompute=args.recompute,
            virtual_stages=args.virtual_stages,
        )
        costs = RecoveryCosts(
            detect_s=args.detect_s,
            detect_process_s=args.detect_process_s,
            rebuild_s=args.rebuild_s,
            transfer_gbps=args.transfer_gbps,
            partial_replay=not args.whole_step_replay,
            recycle_hidden=args.recycle_hidden,
            replan_s=args.replan_s,
            process_start_s=args.process_start_s,
            storage_gbps=args.storage_gbps,
            checkpoint_interval_s=None if args.checkpoint_interval is None else parse_duration(args.checkpoint_interval),
            redundant_forward=args.redundant_forward,
            straggler_detect_steps=args.straggler_detect_steps,
        )
        trace = trace_from_arg(args.trace, initial_nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                               horizon_s=horizon)
        if args.spares < 0:
            raise ValueError(f"--spares must be >= 0, got {args.spares}")
        report = simulate(cluster, costs, trace, horizon_s=horizon, policies=policies, spares=args.spares,
                          stragglers=args.straggler_policy)
    except ValueError as exc:  # bad flags, a bad trace or profile, or no feasible plan
        raise UsageError(str(exc)) from None
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0
