"""Issue 13 part 2: seconds for a generation's group rendezvous at W simulated ranks, on a real etcd.

    .venv/bin/python bench/rendezvous_scale.py --world 8 64 256 1024 [--pattern lazy eager nccl] [--repeats 3]

Each simulated rank is a thread holding its own `EtcdStore` (the project's real store, all on one
etcd client, as one process's workers would share a channel) seen through the same
`PrefixStore(group_prefix(g, None), store)` that `build_groups` hands to the world group, so
every call crosses torch's C++ -> Python store trampoline as gloo's do. There is no gloo mesh and
no model: each rank replays the store calls that a gloo world group of W ranks makes, as logged
from `ProcessGroupGloo` on torch 2.13 (a logging store under 4 and 8 real ranks):

- `eager` (the default construction): `set(<dev>/<rank>, address)`, then for every rank i,
  itself included, in order: `wait([<dev>/<i>])`, `get(<dev>/<i>)`. W sets and 2 W^2 reads in
  all, whatever the store: a full mesh needs every rank to read every other rank's address.
- `lazy` (`TORCH_GLOO_LAZY_INIT=1`): the construction makes one `set`; each peer a rank first
  talks to costs a `wait` + `get` of its key. The pattern is the construction plus the first ring
  all-reduce over the world group (peers rank+1 and rank-1), W sets and 4 W reads in all.
- `nccl`: NCCL's unique-id exchange through the store, as `ProcessGroupNCCL` makes it when a
  communicator is created (lazily, at its first collective): rank 0 `set`s the 128-byte
  `ncclUniqueId` under the group's key, every other rank `get`s it (a blocking get: `wait` then
  read). One set and W - 1 blocking reads; NCCL's own bootstrap then runs over the network, not
  the store, and is not simulated. (torch's multi-root initialisation, `ncclCommInitRankScalable`,
  sets one id per root and is not this pattern.)

A rendezvous is timed from the release of all W threads (a barrier) until the last one is done.
etcd requests come from etcd's own /metrics (`grpc_server_started_total`, every method), read
before and after, so the figure is what etcd served, not what the client believes it sent.
Every figure is one Python process on a 2-core machine: W ranks' client-side work (gRPC calls,
protobuf decoding) is serialised by the GIL where real workers run it in parallel, so the
seconds here overstate what W processes on W hosts would see.
"""

from __future__ import annotations

import argparse
import re
import threading
import time
import urllib.request
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from elastic.coordinator import EtcdConfig, EtcdServer, EtcdStore, JobKeys, connect
from elastic.parallel.groups import group_prefix

PATTERNS = ("eager", "lazy", "nccl")
_ADDRESS = "x" * 154  # a gloo tcp address record measured on torch 2.13 is 154-186 bytes
_UNIQUE_ID = b"\x02" * 128  # sizeof(ncclUniqueId)
_METRIC = re.compile(r'^grpc_server_started_total\{[^}]*grpc_method="(\w+)"[^}]*\} (\d+)', re.M)


def etcd_requests(endpoint: str) -> dict[str, int]:
    """gRPC requests etcd has started since it came up, by method (Range, Put, Txn, Watch, ...)."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
    counts: dict[str, int] = {}
    for method, n in _METRIC.findall(text):
        counts[method] = counts.get(method, 0) + int(n)
    return counts


def _rank_calls(store: dist.Store, rank: int, world: int, pattern: str) -> None:
    """The store calls world rank `rank` makes while its gloo world group of `world` connects."""
    timeout = timedelta(seconds=120)
    if pattern == "nccl":
        if rank == 0:
            store.set("0/unique-id", _UNIQUE_ID)
        else:
            store.wait(["0/unique-id"], timeout)
            store.get("0/unique-id")
        return
    store.set(f"0/{rank}", _ADDRESS)
    peers = range(world) if pattern == "eager" else sorted({(rank + 1) % world, (rank - 1) % world})
    for peer in peers:
        store.wait([f"0/{peer}"], timeout)
        store.get(f"0/{peer}")


def _one_rendezvous(
    client: Any, job: str, generation: int, world: int, pattern: str
) -> tuple[float, EtcdStore]:
    """Seconds until all `world` simulated ranks replayed their calls on a fresh generation, and
    a store of that generation (to drop its keys once the requests were counted)."""
    keys = JobKeys(job)
    stores = [
        EtcdStore(client, keys.store(f"gen-{generation}"), timeout=timedelta(seconds=120))
        for _ in range(world)
    ]
    prefixed = [dist.PrefixStore(group_prefix(generation, None), s) for s in stores]
    start = threading.Barrier(world + 1)
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        start.wait()
        try:
            _rank_calls(prefixed[rank], rank, world, pattern)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} of {world} simulated ranks failed: {errors[0]!r}")
    return seconds, stores[0]


def rendezvous_seconds(
    endpoint: str, world: int, *, repeats: int = 1, pattern: str = "lazy"
) -> dict[str, Any]:
    """Time `repeats` generation rendezvous of `world` simulated ranks on the etcd at `endpoint`.

    Returns `seconds` (median over repeats), `seconds_all`, `requests_per_rank` (etcd requests
    of all methods per rank and rendezvous, from etcd's /metrics), `requests_by_method` (per
    rendezvous) and the `world`, `pattern` and `repeats` it ran with. `pattern` is `lazy` (a
    gloo world group with TORCH_GLOO_LAZY_INIT=1 and its first ring all-reduce), `eager` (the
    full-mesh construction) or `nccl` (NCCL's unique-id exchange); see the module doc.
    """
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
    if world < 1 or repeats < 1:
        raise ValueError(f"world and repeats must be >= 1, got {world} and {repeats}")
    client = connect(EtcdConfig(endpoint=endpoint, timeout=60.0))
    job = f"rdzv-bench-{uuid.uuid4().hex[:8]}"
    try:
        before = etcd_requests(endpoint)
        runs = [_one_rendezvous(client, job, g, world, pattern) for g in range(1, repeats + 1)]
        after = etcd_requests(endpoint)
        for _, store in runs:
            store.delete_prefix()
    finally:
        client.close()
    times = [t for t, _ in runs]
    by_method = {m: (after.get(m, 0) - before.get(m, 0)) / repeats for m in after}
    by_method = {m: n for m, n in by_method.items() if n}
    total = sum(by_method.values())
    return {
        "world": world,
        "pattern": pattern,
        "repeats": repeats,
        "seconds": sorted(times)[len(times) // 2],
        "seconds_all": [round(t, 4) for t in times],
        "requests_per_rank": total / world,
        "requests_by_method": by_method,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--pattern", choices=PATTERNS, nargs="+", default=["lazy"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--endpoint", help="an etcd to use (default: start a fresh one)")
    args = parser.parse_args()
    print(f"{'pattern':>8} {'W':>6} {'seconds':>9} {'etcd req/rank':>14}  by method (per rendezvous)")
    with EtcdServer() if args.endpoint is None else _external(args.endpoint) as server:
        for pattern in args.pattern:
            for world in args.world:
                r = rendezvous_seconds(server.endpoint, world, repeats=args.repeats, pattern=pattern)
                methods = ", ".join(f"{m} {n:g}" for m, n in sorted(r["requests_by_method"].items()))
                print(
                    f"{pattern:>8} {world:>6} {r['seconds']:>9.3f} {r['requests_per_rank']:>14.1f}  {methods}",
                    flush=True,
                )


class _external:
    """A context manager standing in for `EtcdServer` when `--endpoint` names a running etcd."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def __enter__(self) -> _external:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main()
