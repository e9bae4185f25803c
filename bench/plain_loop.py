"""The training loop a user would write without this framework: bench/gpu_check.py's baseline.

    PYTHONPATH=. python -m bench.plain_loop --model gpt2-124m --device cuda --out plain.json

The same GPT as the engine's one worker (`GPTStage` of every layer, TP 1, the same seeded
initialisation), the same samples and dropout keys per step, the same hyperparameters
(`OptimConfig()`, which `elastic run`'s defaults equal): gradient accumulation over the step's
microbatches, forward and loss under `compute_precision` (bf16 autocast on CUDA), the global
gradient norm clipped, torch's AdamW (fused on a GPU; weight decay on matrices only, as the
engine's), the step's learning rate from the engine's schedule. Batches are pinned and copied
without blocking on a GPU. The loss stays on the device during the step and is read once at its
end (`.item()`: the one host sync a loop that logs its loss has); that instant is the step's
commit time.

Writes one JSON object: step commit times, losses, the device's name and versions, peak memory
(`max_memory_allocated` on a GPU, peak RSS on the CPU) and a large matmul's FLOP/s measured
after the steps (bench/mfu.py's); with `--profile-trace DIR`, three more steps under
torch.profiler (bench/trace_summary.py).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from elastic.data.dataset import TokenDataset, step_sample_indices
from elastic.engine.device import compute_precision, select_device
from elastic.engine.optim import OptimConfig, lr_at
from elastic.engine.step import dropout_key
from elastic.model.config import GPTConfig, get_preset
from elastic.model.gpt import GPTStage

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.mfu import matmul_flops  # noqa: E402
from bench.trace_summary import profile_steps  # noqa: E402

PROFILED_STEPS = 3
"""Steps run under the profiler after the measured ones (`--profile-trace`)."""


class PlainLoop:
    """The model, its optimizer and the data of the plain loop on one device."""

    def __init__(self, cfg: GPTConfig, device: torch.device, *, global_batch: int, microbatch: int) -> None:
        self.cfg, self.device = cfg, device
        self.global_batch, self.microbatch = global_batch, microbatch
        self.optim = OptimConfig()
        self.model = GPTStage(cfg, device=device)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.optim.lr, betas=self.optim.betas, eps=self.optim.eps,
            fused=True if device.type != "cpu" else None,
        )
        self.data = TokenDataset(seq_len=cfg.seq_len, seed=0)

    def _batch(self, samples: range) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data.batch(samples)
        if self.device.type == "cpu":
            return x, y
        return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)

    def step(self, step: int) -> float:
        """Run optimizer step `step`; its mean loss over the global batch."""
        samples = step_sample_indices(step, self.global_batch)
        count = self.global_batch // self.microbatch
        loss_sum = torch.zeros((), device=self.device)
        for m in range(count):
            x, y = self._batch(samples[m * self.microbatch : (m + 1) * self.microbatch])
            with compute_precision(self.device):
                loss = self.model.loss(self.model(x, dropout_key=dropout_key(step, m)), y) / count
            loss.backward()
            loss_sum += loss.detach()
        if self.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.optim)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss_sum.item())


def device_info(device: torch.device) -> dict[str, Any]:
    """The device's name, torch and CUDA versions, and memory (None on the CPU)."""
    on_cpu = device.type == "cpu"
    return {
        "type": device.type,
        "name": "cpu" if on_cpu else torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "memory_bytes": None if on_cpu else torch.cuda.get_device_properties(device).total_memory,
    }


def peak_memory(device: torch.device) -> dict[str, Any]:
    """This process's peaks: the caching allocator's on a GPU (and the device's used memory now:
    the context, the pool the allocator keeps, any other process), else the resident set."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    if device.type == "cpu":
        return {"measure": "peak RSS (cpu)", "bytes": rss, "allocated": None, "reserved": None, "rss": rss,
                "device_used": None}
    allocated = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"measure": "max_memory_allocated", "bytes": allocated, "allocated": allocated,
            "reserved": torch.cuda.max_memory_reserved(device), "rss": rss,
            "device_used": total - free}  # context, the allocator's pool (never given back) and the rest


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)  # as the engine's worker (JobSpec.threads_per_worker)
    device = select_device(0, want=args.device)
    cfg = get_preset(args.model)
    loop = PlainLoop(cfg, device, global_batch=args.global_batch, microbatch=args.microbatch)
    losses, committed_at = [], []
    start = time.time()
    for step in range(args.steps):
        losses.append(loss := loop.step(step))
        committed_at.append(time.time())
        print(f"plain loop: step {step + 1}/{args.steps}  loss {loss:.4f}", flush=True)
    memory = peak_memory(device)  # before the matmul and the profiler allocate anything
    on_cpu = device.type == "cpu"
    matmul = matmul_flops(device, torch.float32 if on_cpu else torch.bfloat16, 1024 if on_cpu else 8192,
                          5 if on_cpu else 50)
    result: dict[str, Any] = {
        "steps_committed": len(losses),
        "losses": losses,
        "step_committed_at": committed_at,
        "started_at": start,
        "device": device_info(device),
        "precision": "fp32" if on_cpu else "bf16 autocast",
        "peak_memory": memory,
        "matmul_flops": matmul,
        "matmul_dtype": "fp32" if on_cpu else "bf16",
    }
    if args.profile_trace is not None:
        result["profile"] = profile_steps(lambda i: loop.step(args.steps + i), PROFILED_STEPS,
                                          Path(args.profile_trace) / "plain_trace.json.gz")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.plain_loop", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--microbatch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile-trace", default=None, metavar="DIR", help="also profile 3 steps; trace here")
    parser.add_argument("--out", required=True, help="write the result JSON here")
    args = parser.parse_args(argv)
    if args.global_batch % args.microbatch:
        raise SystemExit("--global-batch must be a multiple of --microbatch")
    Path(args.out).write_text(json.dumps(run(args), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
