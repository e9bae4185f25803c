"""Static worker entry point: `python -m elastic.roles.static_worker --spec FILE --node N --local-rank L`.

The static launcher (static_launcher.py, `elastic run --static`) starts one such process per
(node, device), for a fixed plan with no failure handling. The worker joins the job through the
store at --store-host/--store-port (hosted by the launcher) and runs the job spec.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta

import torch.distributed as dist

from elastic.engine.static_loop import run_worker
from elastic.records.job import JobSpec


def connect_store(host: str, port: int, *, timeout_s: float) -> dist.Store:
    """A client of the launcher's TCPStore."""
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elastic.roles.static_worker", description=__doc__)
    parser.add_argument("--spec", required=True, help="job spec JSON written by the launcher")
    parser.add_argument("--node", type=int, required=True, help="node id of this worker")
    parser.add_argument("--local-rank", type=int, required=True, help="worker index inside the node")
    parser.add_argument("--store-host", default="127.0.0.1")
    parser.add_argument("--store-port", type=int, required=True)
    args = parser.parse_args(argv)
    spec = JobSpec.load(args.spec)
    store = connect_store(args.store_host, args.store_port, timeout_s=spec.collective_timeout_s)
    run_worker(spec, node=args.node, local_rank=args.local_rank, store=store)
    return 0


if __name__ == "__main__":
    sys.exit(main())
