"""One GPU, measured: the engine on one worker beside the training loop a user would write.

    bash bench/gpu_check.sh                                   # gpt2-124m, bf16, on the GPU
    bash bench/gpu_check.sh --model gpt3-350m --microbatch 4 --global-batch 16 --profile-trace /tmp/trace
    bash bench/gpu_check.sh --device cpu --model tiny --steps 8   # CI: keeps it from rotting

Phases, each in its own processes and timed (one line each, so a device budget can be planned):

1. plain: bench/plain_loop.py, the same GPT (`GPTStage` of every layer, TP 1), the same samples
   and hyperparameters, torch's fused AdamW, autocast, no framework;
2. engine --static: `python -m elastic.cli.main run --static --nodes 1 --plan P` (one worker, no
   control plane);
3. engine under the control plane: the same without `--static` (embedded etcd, an agent, the
   leader; `--checkpoint-every 0` unless `--checkpoint-every N`); `--skip-control-plane` where
   etcd or python3-etcd3 is missing;
4. with `--profile-trace DIR`: 3 engine steps under torch.profiler, in one process running the
   engine's own `Trainer` (bench/engine_profile.py), and 3 plain-loop steps in the plain phase:
   top-10 kernels, the GPU's idle time inside the steps, both traces gzipped in DIR.

Every run takes the same plan: one node, one pipeline of one stage, `--global-batch` samples per
step in microbatches of `--microbatch`. Tokens/s counts the steps after `--warmup`: (steps -
warmup) x global batch x seq_len over the wall time from the last warm-up step's commit to the
last step's. MFU divides model FLOP/s (bench/mfu.py's count: 3x the forward FLOPs, attention
counted full) by the card's dense bf16 datasheet peak (bench/mfu.py's DATASHEET_PEAK; 989
TFLOP/s for an H100 SXM), or `--peak-tflops`, or else the large matmul measured in the plain
phase (fp32 on the CPU). Peak memory: `torch.cuda.max_memory_allocated` in the plain loop; in
the engine's worker, the same figure read by bench/hooks/sitecustomize.py at the run's last
commit; both held against the planner's estimate (`elastic.planning.memory.worker_memory`, "no
estimate" while that module is missing) less its `reserve` (the CUDA context and communicators,
which the allocator does not see; the device's used memory is in the JSON too). On the CPU the
peaks are peak RSS, not comparable.

Targets (enforced on CUDA only; on the CPU they are reported, not enforced, and the JSON says
so): engine --static >= 0.95x the plain loop's tokens/s; under the control plane >= 0.93x; each
engine run's peak memory within 15 % of the estimate. Enforced everywhere: every run commits all
its steps, and the first step's loss is the plain loop's (the same model on the same data).
Exit status 1 when an enforced check fails. Writes one JSON (`--json`, default
RUN_DIR/gpu_check.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gpu_check_figures import checks, derive, planner_estimate, print_table  # noqa: E402
from bench.gpu_check_phases import Settings, run_phases  # noqa: E402
from elastic.model.config import get_preset  # noqa: E402

DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": {"model": "gpt2-124m", "global_batch": 32, "microbatch": 8, "steps": 40, "warmup": 5},
    "cpu": {"model": "tiny", "global_batch": 8, "microbatch": 2, "steps": 8, "warmup": 2},
}
"""Per-device defaults of the flags left out."""


def parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(prog="bench/gpu_check.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--model", default=None, help="model preset (default: gpt2-124m on cuda, tiny on cpu)")
    parser.add_argument("--global-batch", type=int, default=None, help="samples per step (default 32 / 8 on cpu)")
    parser.add_argument("--microbatch", type=int, default=None, help="samples per microbatch (default 8 / 2 on cpu)")
    parser.add_argument("--steps", type=int, default=None, help="steps of each run (default 40 / 8 on cpu)")
    parser.add_argument("--warmup", type=int, default=None, help="first steps left out of tokens/s (default 5 / 2)")
    parser.add_argument("--run-dir", type=Path, default=None, help="runs, logs and the JSON (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="the result (default RUN_DIR/gpu_check.json)")
    parser.add_argument("--skip-control-plane", action="store_true",
                        help="leave out the run under the control plane (no etcd binary or python3-etcd3 here)")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                        help="control-plane run: checkpoint every N steps (default 0: none, as --static)")
    parser.add_argument("--profile-trace", type=Path, default=None, metavar="DIR",
                        help="also profile 3 engine steps and 3 plain steps; traces and top kernels in DIR")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the peak MFU divides by, for a card bench/mfu.py's DATASHEET_PEAK does not know")
    parser.add_argument("--phase-timeout", type=float, default=300.0, help="seconds each phase may take")
    args = parser.parse_args(argv)
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        get_preset(args.model)
    except ValueError as exc:
        parser.error(str(exc))
    if args.global_batch % args.microbatch:
        parser.error("--global-batch must be a multiple of --microbatch")
    if not 1 <= args.warmup <= args.steps - 2:
        parser.error("need 1 <= --warmup <= --steps - 2 (tokens/s spans the steps after the warm-up)")
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    return Settings(
        model=args.model, device=args.device, global_batch=args.global_batch, microbatch=args.microbatch,
        steps=args.steps, warmup=args.warmup, run_dir=run_dir.resolve(),
        json_path=(args.json or run_dir / "gpu_check.json").resolve(),
        control_plane=not args.skip_control_plane, checkpoint_every=args.checkpoint_every,
        profile_trace=None if args.profile_trace is None else args.profile_trace.resolve(),
        peak_tflops=args.peak_tflops, phase_timeout_s=args.phase_timeout,
    )


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    started = time.time()
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    print(f"gpu_check: {settings.model} on {settings.device}, run dir {settings.run_dir}", flush=True)
    runs, walls = run_phases(settings)
    estimate = planner_estimate(settings)
    report: dict[str, Any] = {
        "schema": "gpu_check/1",
        "argv": sys.argv[1:] if argv is None else argv,
        "settings": settings.to_dict(),
        "targets_enforced": settings.device == "cuda",
        "targets_note": ("targets enforced (CUDA)" if settings.device == "cuda" else
                         "targets reported, not enforced: speed and memory are not asserted on the CPU"),
        **derive(settings, runs, estimate),
        "estimate": estimate,
        "runs": runs,
        "phase_wall_s": walls,
    }
    report["checks"] = checks(settings, report)
    report["passed"] = all(c["met"] for c in report["checks"] if c["enforced"])
    report["total_wall_s"] = time.time() - started
    settings.json_path.parent.mkdir(parents=True, exist_ok=True)
    settings.json_path.write_text(json.dumps(report, indent=1))
    print_table(report)
    print(f"gpu_check: {'PASSED' if report['passed'] else 'FAILED'}; JSON {settings.json_path}; "
          f"{report['total_wall_s']:.1f} s in all", flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
