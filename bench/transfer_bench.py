"""Shard-transfer throughput: gRPC `fetch_shards` against gloo send/recv, same tensors, same run.

One holder process serves a shard of `--tensors` fp32 tensors of `--tensor-mib` MiB each; the
bench process fetches it over 127.0.0.1 with several chunk sizes (the client picks the chunk
size through `max_reply_bytes`). The baseline moves the same tensors between two processes with
gloo `send`/`recv` over loopback. Each measurement is the best of `--repeats`; the report gives
GB/s (10^9 bytes/s) and the ratio gRPC / gloo.

    .venv/bin/python bench/transfer_bench.py                              # 256 MiB, chunks 1/4/16 MiB
    .venv/bin/python bench/transfer_bench.py --tensors 8 --tensor-mib 8 --chunks-mib 4 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import socket
import time
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from elastic.transfer import FetchConfig, ServerConfig, ShardServer, fetch_shards
from elastic.transfer.server import HEADER_ALLOWANCE

TOKEN = "bench-token"


def make_tensors(count: int, mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(mib << 18, generator=g) for i in range(count)}  # (mib MiB / 4 bytes,)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- gRPC -------------------------------------------------------------------------------------


def holder_main(conn: Connection, count: int, mib: int, max_chunk: int) -> None:
    tensors = make_tensors(count, mib)
    server = ShardServer(
        ServerConfig(token=TOKEN, chunk_bytes=max_chunk), provider=lambda layer, tp: tensors
    ).start()
    conn.send(server.port)
    conn.recv()  # until the bench says stop
    server.stop()


def bench_grpc(count: int, mib: int, chunks: list[int], repeats: int) -> dict[int, float]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=holder_main, args=(child, count, mib, max(chunks)))
    proc.start()
    try:
        address = f"127.0.0.1:{parent.recv()}"
        reference = make_tensors(count, mib)
        results = {}
        for chunk in chunks:
            config = FetchConfig(token=TOKEN, generation=0, max_reply_bytes=chunk + HEADER_ALLOWANCE)
            best = float("inf")
            for _ in range(repeats):
                result = fetch_shards([(0, 0)], {address: [(0, 0)]}, config)
                best = min(best, result.seconds)
            got = result.shards[(0, 0)]
            assert all(torch.equal(got[n], reference[n]) for n in reference), "gRPC transfer not exact"
            results[chunk] = result.bytes_moved / best / 1e9
        parent.send("stop")
        proc.join(30)
        return results
    finally:
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(5)


# ---- gloo baseline ----------------------------------------------------------------------------


def gloo_main(rank: int, port: int, count: int, mib: int, repeats: int, conn: Connection) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    try:
        tensors = make_tensors(count, mib)
        buffers = [torch.empty_like(t) for t in tensors.values()]
        best = float("inf")
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            for t, buf in zip(tensors.values(), buffers, strict=True):
                if rank == 0:
                    dist.send(t, dst=1)
                else:
                    dist.recv(buf, src=0)
            best = min(best, time.perf_counter() - start)
        if rank == 1:
            assert all(torch.equal(b, t) for b, t in zip(buffers, tensors.values(), strict=True))
            conn.send(sum(t.numel() * t.element_size() for t in tensors.values()) / best / 1e9)
    finally:
        dist.destroy_process_group()


def bench_gloo(count: int, mib: int, repeats: int) -> float:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    port = free_port()
    procs = [ctx.Process(target=gloo_main, args=(r, port, count, mib, repeats, child)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        rate = float(parent.recv())
        for p in procs:
            p.join(60)
        return rate
    finally:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tensors", type=int, default=16, help="tensors in the shard")
    parser.add_argument("--tensor-mib", type=int, default=16, help="size of each tensor (MiB)")
    parser.add_argument("--chunks-mib", default="1,4,16", help="gRPC chunk sizes to try (MiB, comma-separated)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (best is kept)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()
    chunks = [int(float(c) * (1 << 20)) for c in args.chunks_mib.split(",")]

    gloo = bench_gloo(args.tensors, args.tensor_mib, args.repeats)
    grpc_rates = bench_grpc(args.tensors, args.tensor_mib, chunks, args.repeats)
    total_mib = args.tensors * args.tensor_mib
    if args.json:
        print(
            json.dumps(
                {
                    "total_mib": total_mib,
                    "gloo_gbps": gloo,
                    "grpc_gbps": {str(c >> 10) + "KiB": r for c, r in grpc_rates.items()},
                    "ratio_grpc_over_gloo": {str(c >> 10) + "KiB": r / gloo for c, r in grpc_rates.items()},
                }
            )
        )
        return
    print(f"{total_mib} MiB in {args.tensors} fp32 tensors over 127.0.0.1, best of {args.repeats}")
    print(f"{'path':<24}{'GB/s':>8}{'ratio vs gloo':>16}")
    print(f"{'gloo send/recv':<24}{gloo:>8.2f}{1.0:>16.2f}")
    for chunk, rate in grpc_rates.items():
        print(f"{f'gRPC, {chunk / (1 << 20):g} MiB chunks':<24}{rate:>8.2f}{rate / gloo:>16.2f}")


if __name__ == "__main__":
    main()
