"""Saved activations per layer and microbatch, measured against the memory model (issue 54).

    python -m bench.activation_memory                      # gpt2-124m, seq 1024, one block, TP 1 and 2
    python -m bench.activation_memory --dropout 0.1        # the attention probabilities kept, as in the paper
    python -m bench.activation_memory --model tiny --json out.json

For each recompute mode (model/gpt.py), tensor-parallel degree and, at TP > 1, sequence
parallelism off and on, one transformer block's forward
runs under `torch.autograd.graph.saved_tensors_hooks`, which sees every tensor autograd keeps for
the backward; the distinct storages that are not parameters are summed (a view's storage counts
once). TP 2 runs its two ranks as threads over real gloo communicators. Beside each figure: the
memory model's (`elastic.planning.activation_memory.layer_saved`), in fp32 (the CPU's compute
dtype) and under bf16 autocast (CUDA's). The baseline is `none` at TP 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic.comm import open_communicator
from elastic.model import TensorParallel
from elastic.model.config import RECOMPUTE_MODES, GPTConfig, get_preset
from elastic.model.gpt import GPTStage
from elastic.planning.activation_memory import layer_saved, saved_bytes
from elastic.planning.profiler import forward_counting_saved

MIB = 1 << 20


def measure(cfg: GPTConfig, tp: TensorParallel, mode: str, dtype: torch.dtype, microbatch: int, sp: bool) -> int:
    """Bytes of the distinct non-parameter storages one block's forward saves on this rank."""
    stage = GPTStage(cfg, first=1, last=2, tp=tp, recompute=mode, sequence_parallel=sp)
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    x = torch.randn(microbatch, cfg.seq_len // stage.seq_shards, cfg.d_model, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        _, saved = forward_counting_saved(lambda: stage(x, dropout_key=0), params)
    return saved


def measure_tp(cfg: GPTConfig, degree: int, mode: str, dtype: torch.dtype, microbatch: int, sp: bool) -> list[int]:
    """`measure` on every rank of a `degree`-way tensor-parallel group."""
    if degree == 1:
        return [measure(cfg, TensorParallel.single(), mode, dtype, microbatch, sp)]
    store = dist.HashStore()
    got: list[Any] = [None] * degree

    def rank(r: int) -> None:
        comm = open_communicator(store, name="tp", members=list(range(degree)), rank=r, backend="gloo",
                                 device=torch.device("cpu"), timeout=timedelta(seconds=600))
        try:
            got[r] = measure(cfg, TensorParallel(group=comm, rank=r, size=degree), mode, dtype, microbatch, sp)
        except Exception as exc:  # reported below
            got[r] = exc
        comm.shutdown()

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in range(degree)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = [g for g in got if not isinstance(g, int)]
    if bad:
        raise SystemExit(f"tensor-parallel measurement failed: {bad}")
    return list(got)


def rows(cfg: GPTConfig, degrees: list[int], microbatch: int) -> list[dict[str, Any]]:
    out = []
    tokens = microbatch * cfg.seq_len
    layouts = [(degree, sp) for degree in degrees for sp in ((False, True) if degree > 1 else (False,))]
    for degree, sp in layouts:
        for mode in RECOMPUTE_MODES:
            for dtype in (torch.float32, torch.bfloat16):
                measured = measure_tp(cfg, degree, mode, dtype, microbatch, sp)
                model = saved_bytes(layer_saved(cfg, 1, degree, mode, sp), tokens=tokens, element_bytes=dtype.itemsize)
                out.append({"tp": degree, "sequence_parallel": sp, "recompute": mode,
                            "dtype": str(dtype).removeprefix("torch."), "measured": measured, "model": model,
                            "equal": all(m == model for m in measured)})
    return out


def table(result: list[dict[str, Any]]) -> str:
    base = {r["dtype"]: r["measured"][0] for r in result if r["tp"] == 1 and r["recompute"] == "none"}
    lines = ["| TP | SP | recompute | dtype | measured MiB (rank 0) | model MiB | equal | vs none at TP 1 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result:
        lines.append(f"| {r['tp']} | {'on' if r['sequence_parallel'] else 'off'} | {r['recompute']} | {r['dtype']} | "
                     f"{r['measured'][0] / MIB:.2f} | "
                     f"{r['model'] / MIB:.2f} | {'yes' if r['equal'] else 'no'} | "
                     f"{r['measured'][0] / base[r['dtype']]:.3f}x |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2-124m")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--microbatch", type=int, default=1)
    parser.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel degrees")
    parser.add_argument("--dropout", type=float, default=None, help="the model's dropout (default: the preset's)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cfg = get_preset(args.model)
    cfg = GPTConfig(**{**cfg.__dict__, "seq_len": args.seq_len,
                       **({} if args.dropout is None else {"dropout": args.dropout})})
    torch.manual_seed(0)
    result = rows(cfg, [int(t) for t in args.tp.split(",")], args.microbatch)
    print(f"{args.model}, seq {args.seq_len}, microbatch {args.microbatch}, dropout {cfg.dropout:g}: saved "
          "activations of one block")
    print(table(result))
    if args.json is not None:
        args.json.write_text(json.dumps({"model": args.model, "seq_len": args.seq_len, "microbatch": args.microbatch,
                                         "dropout": cfg.dropout, "rows": result}, indent=1))
    return 0 if all(r["equal"] for r in result) else 1


if __name__ == "__main__":
    sys.exit(main())
