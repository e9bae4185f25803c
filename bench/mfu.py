"""Tokens/s and model FLOPs utilisation of one worker (TP=1, one stage = the whole model).

Baseline in the same run: a large bf16 (fp32 on CPU) matmul on the same device, whose
achieved FLOP/s is the practical ceiling; the report gives model FLOP/s as a ratio of it and,
for known GPUs, of the datasheet peak.

    .venv/bin/python bench/mfu.py --model gpt2-124m --microbatch 8 --steps 20 --device cuda   # on a GPU
    .venv/bin/python bench/mfu.py --model tiny --steps 5 --device cpu                          # CPU smoke run

`--device auto` (the default) takes the GPU when there is one, else the CPU; `cuda` insists on
a GPU (bf16 autocast, fused AdamW), `cpu` stays on the CPU (fp32). bench/gpu_check.py measures
the same loop beside the engine.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from elastic.data import TokenDataset
from elastic.engine.device import compute_precision, select_device
from elastic.model import GPTStage, get_preset
from elastic.model.config import GPTConfig

# Dense bf16 tensor-core peaks from the vendors' datasheets (FLOP/s); the longest key found in
# the device's name wins ("H100 PCIe" before "H100", which is the SXM part).
DATASHEET_PEAK = {
    "H100": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12,
}


def datasheet_peak(device_name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of the card called `device_name`; None for an unknown one."""
    known = [k for k in DATASHEET_PEAK if k in device_name]
    return DATASHEET_PEAK[max(known, key=len)] if known else None


def flops_per_token(cfg: GPTConfig) -> float:
    """Forward + backward FLOPs per token: 3x the forward count of every layer."""
    return 3.0 * sum(cfg.layer_flops_per_token(i) for i in range(cfg.num_layers))


def model_flops_per_token(name: str) -> float:
    """`flops_per_token` of the preset called `name`."""
    return flops_per_token(get_preset(name))


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int, reps: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2.0 * n**3 * reps / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: the GPU when there is one (default); cuda: bf16 autocast; cpu: fp32")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()

    device = select_device(0, want=args.device)
    on_cpu = device.type == "cpu"
    cfg = get_preset(args.model)
    model = GPTStage(cfg, device=device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not on_cpu)
    data = TokenDataset(seq_len=cfg.seq_len)

    def step(i: int) -> float:
        inputs, targets = data.batch(range(i * args.microbatch, (i + 1) * args.microbatch))
        inputs, targets = inputs.to(device), targets.to(device)
        with compute_precision(device):
            loss = model.loss(model(inputs), targets)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        return float(loss.item())

    for i in range(args.warmup):
        step(i)
    _sync(device)
    start = time.perf_counter()
    for i in range(args.steps):
        loss = step(args.warmup + i)
    _sync(device)
    seconds = time.perf_counter() - start
    tokens_per_s = args.steps * args.microbatch * cfg.seq_len / seconds
    model_flops = tokens_per_s * model_flops_per_token(args.model)
    matmul = matmul_flops(device, torch.float32 if on_cpu else torch.bfloat16, 1024 if on_cpu else 8192, 5 if on_cpu else 50)
    device_name = "cpu" if on_cpu else torch.cuda.get_device_name(device)
    peak = datasheet_peak(device_name)
    result = {
        "model": args.model,
        "device": device_name,
        "microbatch": args.microbatch,
        "seq_len": cfg.seq_len,
        "precision": "fp32" if on_cpu else "bf16 autocast",
        "tokens_per_s": tokens_per_s,
        "model_tflops": model_flops / 1e12,
        "matmul_tflops_same_run": matmul / 1e12,
        "ratio_to_matmul": model_flops / matmul,
        "mfu_datasheet": None if peak is None else model_flops / peak,
        "final_loss": loss,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
