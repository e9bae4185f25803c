"""Recovery time of a live reconfiguration, kill -> next committed step, against bytes moved (issue 6).

    .venv/bin/python bench/recovery.py --models tiny small [--nodes 4] [--steps 12] [--kill-step 6]
    .venv/bin/python bench/recovery.py --models gpt2-124m --steps 4 --kill-step 3 --microbatch 1 --microbatches 4 \
        --kill-at 0 0.5 --whole-step
    .venv/bin/python bench/recovery.py --device cuda --models gpt2-124m --steps 8 --kill-step 4 --kill-at 0.5
    .venv/bin/python bench/recovery.py --models tiny small --pipelines 4 --shard-optimizer both

For each model: a failure-free elastic run (4 nodes, 2 pipelines x 2 stages, so a lost node's
layers must move), then the same run with `kill:node=2,step=K,at=F` for each `--kill-at` F (the
fraction of a step into step K at which node 2 is SIGKILLed; 0: as soon as step K is in
flight). Prints the recovery breakdown (detect, finish kept microbatches, plan, transfer,
rebuild groups, replay), the replayed fraction of the step, the bytes moved, and baselines
taken in the same invocation: the failure-free run's steady step time (recovery in units of
steps), its cold start (launcher start -> first commit: what restarting the whole job would cost
before any checkpoint restore) and, with `--whole-step`, the same kill with partial replay off
(the whole interrupted step is replayed: the runtime before issue 14). Every run must end with
the failure-free losses (checked).

`--pipelines 4` lays the 4 nodes as 4 one-stage pipelines instead (f = 1), where each layer's
optimizer state is 2 slices of 2 owners when sharded; `--shard-optimizer both` runs every case
without and with it (issue 55: the sharded run's survivors fetch the moment slices they now own).

`--device cuda`: the workers run on GPUs (NCCL, bf16 autocast: `elastic.engine.device`), one
device per worker as the engine assigns them; `--device cpu` (the default): gloo, fp32.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from elastic.engine.optim import OptimConfig  # noqa: E402
from elastic.model.config import get_preset  # noqa: E402
from elastic.planning.cluster import DEFAULT_MEMORY_GIB, ClusterSpec, cluster_templates, initial_plan  # noqa: E402
from elastic.records.config import ElasticConfig  # noqa: E402
from elastic.records.injection import parse_injection  # noqa: E402
from elastic.records.job import JobSpec  # noqa: E402
from elastic.records.summary import RunSummary  # noqa: E402
from elastic.roles.launcher import launch_elastic  # noqa: E402
from templates.plan import even_plan  # noqa: E402


def run(
    model: str,
    nodes: int,
    steps: int,
    inject: tuple[str, ...],
    run_dir: Path,
    *,
    microbatch: int,
    microbatches: int,
    lease_ttl: int = 3,
    stop: threading.Event | None = None,
    device_memory_gib: float | None = None,
    partial_replay: bool = True,
    spares: int = 0,
    device: str = "cpu",
    pipelines: int = 2,
    shard_optimizer: str = "off",
) -> RunSummary:
    """One elastic run: `nodes` nodes as 2 pipelines (f = 1), the given `--inject` values, node
    leases of `lease_ttl` s. Setting `stop` ends it early (launch_elastic raises JobFailed).

    The first plan splits the layers evenly over 2 pipelines, so that a lost node's layers must
    move; with `device_memory_gib` the planner's derived profile gets that memory per node, and
    the first plan is the planner's own (as `elastic run` makes it), so that the leader's
    re-plans stay in the same regime (a small budget keeps every pipeline multi-stage). `spares`:
    hot spare nodes beside them (`elastic run --spares`). `device`: the workers' device ("cpu",
"cuda" or "auto", as `elastic run --device`). `pipelines`: of the even first plan;
`shard_optimizer`: as `elastic run --shard-optimizer`."""
    layers = get_preset(model).num_layers
    cluster = ClusterSpec(
        model=model, nodes=nodes, fault_tolerance=1, global_batch=microbatch * microbatches, microbatch=microbatch,
        device_memory_gib=DEFAULT_MEMORY_GIB if device_memory_gib is None else device_memory_gib,
    )
    if device_memory_gib is None:
        plan = even_plan(num_layers=layers, nodes=list(range(nodes)), num_pipelines=pipelines,
                         global_microbatches=microbatches, microbatch_size=microbatch, fault_tolerance=1)
    else:
        plan = initial_plan(cluster, cluster_templates(cluster))
    spec = JobSpec(model=model, plan=plan, steps=steps, run_dir=str(run_dir), optim=OptimConfig(eps=1e-6),
                   device=device, collective_timeout_s=300.0, partial_replay=partial_replay,
                   shard_optimizer=shard_optimizer)
    config = ElasticConfig(spec=spec, cluster=cluster, injections=tuple(parse_injection(i) for i in inject),
                           checkpoint_every=0, lease_ttl=lease_ttl, spares=spares)
    return launch_elastic(config, quiet=True, timeout_s=1200.0, stop=stop)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-step", type=int, default=6)
    parser.add_argument("--kill-at", type=float, nargs="+", default=[0.0],
                        help="fractions of a step into step K at which node 2 is killed (one run each)")
    parser.add_argument("--whole-step", action="store_true",
                        help="baseline: each kill again with partial replay off (the whole step replayed)")
    parser.add_argument("--microbatch", type=int, default=2, help="samples per microbatch")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per step (global batch / microbatch)")
    parser.add_argument("--lease-ttl", type=int, default=3, help="node lease TTL in seconds (failure detection bound)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="workers' device: cuda (NCCL, bf16 autocast) or cpu (gloo, fp32; default)")
    parser.add_argument("--pipelines", type=int, default=2, help="pipelines of the even first plan (f = 1)")
    parser.add_argument("--shard-optimizer", choices=("off", "on", "both"), default="off",
                        help="the optimizer's moments sharded over each layer's holders; both: every case twice")
    parser.add_argument(
        "--run-dir", type=Path, default=None, help="keep the runs' logs here (default: a temp dir)"
    )
    args = parser.parse_args()
    rows = []
    root = args.run_dir or Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    print(f"runs under {root}", file=sys.stderr)
    modes = ("off", "on") if args.shard_optimizer == "both" else (args.shard_optimizer,)
    for model in args.models:
        for mode in modes:
            batch = {"microbatch": args.microbatch, "microbatches": args.microbatches, "lease_ttl": args.lease_ttl,
                     "device": args.device, "pipelines": args.pipelines, "shard_optimizer": mode}
            tag = f"{model}-shard-{mode}"
            base = run(model, args.nodes, args.steps, (), root / f"{tag}-base", **batch)
            for at in args.kill_at:
                for partial in (True, False) if args.whole_step else (True,):
                    kill = f"kill:node=2,step={args.kill_step}" + (f",at={at:g}" if at else "")
                    name = f"{tag}-kill-at{at:g}" + ("" if partial else "-whole")
                    hit = run(model, args.nodes, args.steps, (kill,), root / name, partial_replay=partial, **batch)
                    row = {**_row(model, args, base, hit, at=at, partial=partial), "shard_optimizer": mode}
                    rows.append(row)
                    print(json.dumps(row), flush=True)


def _row(model: str, args: argparse.Namespace, base: RunSummary, hit: RunSummary, *, at: float,
         partial: bool) -> dict[str, object]:
    same = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(hit.losses, base.losses, strict=True))
    (rec,) = hit.recoveries
    step = base.steady_step_s
    fraction = rec["replayed_fraction"]
    return {
        "model": model,
        "global_batch": args.microbatch * args.microbatches,
        "kill_at": at,
        "partial_replay": partial,
        "recovery_s": round(rec["total_s"], 3),
        "detect_s": round(rec["detecting_s"], 3),
        "finish_s": round(rec["finishing_s"], 3),
        "plan_s": round(rec["planning_s"], 3),
        "transfer_s": round(rec["transferring_s"], 3),
        "rebuild_s": round(rec["rebuilding_s"], 3),
        "replay_s": round(rec["replaying_s"], 3),
        "replayed_fraction": fraction,
        "bytes_moved": rec["bytes_moved"],
        "steady_step_s": round(step, 3),
        "recovery_in_steps": round(rec["total_s"] / step, 2),
        # Issue 14's targets: gpt2-124m <= 0.6 x step + 2 s; small <= replayed fraction x step + 1.5 s.
        "target_0.6_step_plus_2_s": round(0.6 * step + 2.0, 3),
        "target_fraction_step_plus_1.5_s": None if fraction is None else round(fraction * step + 1.5, 3),
        "cold_start_s": round(base.startup_s, 3),
        "recovery_over_cold_start": round(rec["total_s"] / base.startup_s, 3),
        "losses_match": same,
        "worker_restarts": hit.worker_restarts,
    }

if __name__ == "__main__":
    main()
