"""Shard-transfer throughput: gRPC `fetch_shards` and the collective `exchange` against gloo
send/recv, same tensors, same run.

One holder process serves a shard of `--tensors` fp32 tensors of `--tensor-mib` MiB each; the
bench process fetches it over 127.0.0.1 with several chunk sizes (the client picks the chunk
size through `max_reply_bytes`). The collective side moves the same tensors, as one shard, from
one process to another with `elastic.transfer.collective.exchange` on a gloo group built from a
TCPStore (headers, checksums and verification included). It receives into new tensors each
run, after dropping the last run's, so later runs may get recycled pages while the first gets
freshly faulted ones (first touch costs ~0.3 s/GB on the dev VM): both are reported. The
baseline moves the same tensors between two processes with plain gloo `send`/`recv` over
loopback, into buffers reused across runs. Each measurement is the best of `--repeats`; the
report gives GB/s (10^9 bytes/s) and the ratio to gloo.

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
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import cast

import torch
import torch.distributed as dist

from elastic.transfer.client import FetchConfig, fetch_shards
from elastic.transfer.collective import exchange, plan_moves
from elastic.transfer.server import HEADER_ALLOWANCE, ServerConfig, ShardServer
from elastic.transfer.shards import ShardKey

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


# ---- collective exchange ----------------------------------------------------------------------


def plain_wait(work: dist.Work) -> None:
    work.wait()


def collective_main(rank: int, port: int, count: int, mib: int, repeats: int, conn: Connection) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    group = cast(dist.ProcessGroup, dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60)))
    key = ShardKey(0, 0)
    tensors = make_tensors(count, mib)
    shard = {f"param/{name}": t for name, t in tensors.items()}
    moves = plan_moves({1: [key]}, {key: [0]})
    seconds: list[float] = []
    result = None
    for _ in range(repeats):
        result = None  # drop the last run's tensors first: a warm process recycles their pages
        group.allreduce([torch.zeros(1)]).wait()  # barrier
        start = time.perf_counter()
        result = exchange(group, rank=rank, moves=moves, export=lambda k: shard, wait=plain_wait)
        seconds.append(time.perf_counter() - start)
        if rank == 1:
            assert not result.failed, result.failed
            got = result.shards[key]
            assert got.keys() == shard.keys() and all(torch.equal(got[n], shard[n]) for n in shard)
    if rank == 1 and result is not None:
        conn.send((result.bytes_received / seconds[0] / 1e9, result.bytes_received / min(seconds) / 1e9))
    group.allreduce([torch.zeros(1)]).wait()  # the store's master (rank 0) outlives rank 1's use


def bench_collective(count: int, mib: int, repeats: int) -> tuple[float, float]:
    """(GB/s of the first run, into freshly faulted pages; GB/s of the best run)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    port = free_port()
    procs = [ctx.Process(target=collective_main, args=(r, port, count, mib, repeats, child)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        cold, best = parent.recv()
        for p in procs:
            p.join(60)
        return float(cold), float(best)
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
    collective_cold, collective = bench_collective(args.tensors, args.tensor_mib, args.repeats)
    grpc_rates = bench_grpc(args.tensors, args.tensor_mib, chunks, args.repeats)
    total_mib = args.tensors * args.tensor_mib
    if args.json:
        print(
            json.dumps(
                {
                    "total_mib": total_mib,
                    "gloo_gbps": gloo,
                    "collective_gbps": collective,
                    "collective_first_run_gbps": collective_cold,
                    "ratio_collective_over_gloo": collective / gloo,
                    "grpc_gbps": {str(c >> 10) + "KiB": r for c, r in grpc_rates.items()},
                    "ratio_grpc_over_gloo": {str(c >> 10) + "KiB": r / gloo for c, r in grpc_rates.items()},
                }
            )
        )
        return
    print(f"{total_mib} MiB in {args.tensors} fp32 tensors over 127.0.0.1, best of {args.repeats}")
    print(f"{'path':<52}{'GB/s':>8}{'ratio vs gloo':>16}")
    print(f"{'gloo send/recv':<52}{gloo:>8.2f}{1.0:>16.2f}")
    label = "collective (elastic.transfer.collective.exchange)"
    print(f"{label:<52}{collective:>8.2f}{collective / gloo:>16.2f}")
    print(f"{'  its first run (receives into fresh pages)':<52}{collective_cold:>8.2f}{collective_cold / gloo:>16.2f}")
    for chunk, rate in grpc_rates.items():
        print(f"{f'gRPC, {chunk / (1 << 20):g} MiB chunks':<52}{rate:>8.2f}{rate / gloo:>16.2f}")


if __name__ == "__main__":
    main()
