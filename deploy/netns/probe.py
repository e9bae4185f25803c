"""Cross-namespace check: `python probe.py --etcd HOST:PORT --prefix P --rank R --world W`.

Run once per node namespace (with the node's ELASTIC_HOST and GLOO_SOCKET_IFNAME): the W
probes rendezvous on an etcd-backed store (as the runtime's workers do), all-reduce over a gloo
group (whose device follows GLOO_SOCKET_IFNAME), and each fetches one shard over gRPC from the
next rank's shard server (bound to ELASTIC_HOST). Prints one line and exits 0 when the sum and
the fetched values are right and no address it used is loopback; exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic.comm.opening import open_communicator
from elastic.coordinator.client import connect
from elastic.coordinator.credentials import config_from_env
from elastic.coordinator.netaddr import LOOPBACK, bind_host
from elastic.coordinator.store import EtcdStore
from elastic.transfer.client import FetchConfig, fetch_shards
from elastic.transfer.server import ServerConfig, ShardServer
from elastic.transfer.shards import ShardKey

_TOKEN = "netns-probe"


def probe(*, etcd: str, prefix: str, rank: int, world: int, timeout_s: float) -> str:
    """Run the checks of the module doc; return a one-line report or raise RuntimeError."""
    host = bind_host()
    if host == LOOPBACK:
        raise RuntimeError("ELASTIC_HOST is not set: this probe checks traffic between namespaces")
    client = connect(config_from_env(etcd))
    timeout = timedelta(seconds=timeout_s)
    store = EtcdStore(client, f"netns-probe/{prefix}/", timeout=timeout)
    comm = open_communicator(store, name="netns-probe", members=list(range(world)), rank=rank, backend="gloo",
                             device=torch.device("cpu"), timeout=timeout)
    group = comm.group
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value, group=group)
    want = world * (world + 1) / 2
    if float(value) != want:
        raise RuntimeError(f"gloo all_reduce gave {float(value)}, expected {want}")
    mine = {"w": torch.full((4,), float(rank))}
    with ShardServer(ServerConfig(token=_TOKEN, host=host), provider=lambda layer, tp: mine) as server:
        store.set(f"server/{rank}", server.address)
        peer = (rank + 1) % world
        address = store.get(f"server/{peer}").decode()
        if address.startswith(LOOPBACK):
            raise RuntimeError(f"rank {peer} advertises a loopback address {address}")
        key = ShardKey(peer, 0)
        got = fetch_shards([key], {address: [key]}, FetchConfig(token=_TOKEN, generation=0))
        shard = got.shards[key]["w"]
        if not torch.equal(shard, torch.full((4,), float(peer))):
            raise RuntimeError(f"shard fetched from {address} holds {shard.tolist()}")
        dist.barrier(group=group)  # keep serving until every rank has fetched
    client.close()
    return f"probe rank {rank}/{world} at {host}: gloo all_reduce {float(value):g} ok, gRPC fetch from {address} ok"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--etcd", required=True, help="etcd endpoint HOST:PORT, reachable from every namespace"
    )
    parser.add_argument(
        "--prefix", required=True, help="store key prefix shared by the W probes of one check"
    )
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="seconds for the rendezvous and each step"
    )
    args = parser.parse_args(argv)
    try:
        print(probe(etcd=args.etcd, prefix=args.prefix, rank=args.rank, world=args.world,
                    timeout_s=args.timeout), flush=True)
    except Exception as exc:
        print(f"probe rank {args.rank}: FAILED: {type(exc).__name__}: {exc}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
