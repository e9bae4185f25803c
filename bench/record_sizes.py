"""Issue 34 item 1: the size of what fans out to every worker when a node is lost at N nodes.

    .venv/bin/python bench/record_sizes.py [--nodes 64 256 1024 2048] [--gpus-per-node 8]

Every worker follows the generation records (`plan/<g>`) and the halts (`halt/<g>`): its node's
agent watches each once and hands it to the node's workers (elastic/roles/node_feed.py), so etcd
sends each such record once per node, and each worker decodes it. For a GPT-3 6.7B-shaped model
on N nodes x G GPUs (f = 1, one microbatch a GPU), the planner's first plan loses its first
node; the leader's `replan` gives g+1, and `resolve_replay` keeps the microbatches of every
intact pipeline, every worker of which reports its kept sums; the leader plans the collective
shard path's moves from the survivors' holdings (`plan_moves`) into the record. Printed per N: the
JSON bytes of the generation record (and of its plan, incarnations, replay and moves parts, with
the number of moves and the leader's time to plan them), what etcd stores of it
(`to_packed`: zlib), stored bytes per node, the time to unpack and decode it (what each worker
pays), the halt record, the bytes etcd sends for one record to every node, and what it would
send unpacked to every worker (without the agents' feed), and the holder map (every node's
holdings and registrations as stored) that each worker read to plan the same moves itself before
the leader planned them: bytes from etcd at every change, once per worker. etcd refuses a request over 1.5 MiB
(`--max-request-bytes`), so the stored record must stay under it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.parallel.shard_moves import move_rows, plan_moves, ranked_holdings  # noqa: E402
from elastic.planning.cluster import ClusterSpec, cluster_templates, initial_plan  # noqa: E402
from elastic.records.generation import GenerationRecord, HaltRecord  # noqa: E402
from elastic.records.node_holdings import NodeHoldings  # noqa: E402
from elastic.records.partial import PartialReport, resolve_replay  # noqa: E402
from elastic.transfer.shards import ShardKey  # noqa: E402
from templates.replanning import replan  # noqa: E402

ETCD_MAX_REQUEST = int(1.5 * 2**20)
REGISTRATIONS_PACKED_PER_WORKER = 354 / 8
"""A node's registrations as stored (`workers/<node>/all`, packed): 354 B for 8 workers, measured."""


def measure(nodes: int, gpus: int) -> dict[str, float]:
    spec = ClusterSpec(model="gpt3-6.7b", nodes=nodes, gpus_per_node=gpus, fault_tolerance=1,
                       global_batch=nodes * gpus, microbatch=1, device_memory_gib=80)
    tset = cluster_templates(spec)
    plan = initial_plan(spec, tset)
    lost = plan.pipelines[0].stages[0].node
    new = replan(tset, plan, [n for n in range(nodes) if n != lost]).plan
    reports = []
    held: dict[tuple[int, int], list[tuple[int, int]]] = {}
    start = 0
    for i, pipe in enumerate(plan.pipelines):
        mbs = tuple(range(start, start + pipe.microbatches))
        start += pipe.microbatches
        for st in pipe.stages:
            if st.node != lost:
                held.update({(st.node, t): [(layer, t) for layer in range(st.first, st.last)] for t in range(gpus)})
                reports += [(st.node, t, None if i == 0 else PartialReport(step=100, microbatches=mbs,
                                                                             layers=(st.first, st.last), tp_rank=t))
                            for t in range(gpus)]
    t0 = time.perf_counter()
    replay = resolve_replay(new, reports, step=100)
    resolve_s = time.perf_counter() - t0
    holdings = {w: [ShardKey(*k) for k in ks] for w, ks in held.items()}  # as the leader reads them
    t0 = time.perf_counter()
    moves = move_rows(plan_moves(new, ranked_holdings(new, holdings)))
    moves_s = time.perf_counter() - t0
    record = GenerationRecord(plan=new, resume_step=100, incarnations={n: 0 for n in range(nodes) if n != lost},
                              lost=[lost], reason=f"lost node {lost}", replay=replay, moves=moves)
    text, stored = record.to_json(), record.to_packed()
    t0 = time.perf_counter()
    GenerationRecord.from_json(stored)
    decode_s = time.perf_counter() - t0
    halt = HaltRecord(abort=True, reason=f"lost node {lost}", at=time.time(), lost=[lost])
    workers = nodes * gpus
    holder_map = sum(len(NodeHoldings(node=n, held={t: held[(n, t)] for t in range(gpus)}).to_packed())
                     + REGISTRATIONS_PACKED_PER_WORKER * gpus for n in range(nodes) if n != lost)
    return {
        "nodes": nodes, "workers": workers, "record_bytes": len(text), "stored_bytes": len(stored),
        "plan_bytes": len(json.dumps(json.loads(text)["plan"])),
        "incarnations_bytes": len(json.dumps(json.loads(text)["incarnations"])),
        "replay_bytes": len(replay.to_json()), "moves": len(moves),
        "moves_bytes": len(json.dumps(json.loads(text)["moves"])), "moves_ms": moves_s * 1e3,
        "holder_map_gb": holder_map * workers / 1e9, "bytes_per_node": len(stored) / nodes,
        "decode_ms": decode_s * 1e3, "resolve_ms": resolve_s * 1e3, "halt_bytes": len(halt.to_json()),
        "fanout_mb": len(text) * workers / 1e6, "node_fanout_mb": len(stored) * nodes / 1e6,
        "under_etcd_limit": len(stored) < ETCD_MAX_REQUEST,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[64, 256, 1024, 2048])
    parser.add_argument("--gpus-per-node", type=int, default=8)
    args = parser.parse_args()
    print("| nodes | workers | generation record | stored (packed) | plan | incarnations | replay | moves | "
          "per node | decode | resolve_replay | plan_moves | halt | etcd to every node | unpacked, to every worker | "
          "holder map read by every worker (before) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in args.nodes:
        r = measure(n, args.gpus_per_node)
        assert r["under_etcd_limit"], f"{n} nodes: the record ({r['stored_bytes']} B) exceeds etcd's request limit"
        print(f"| {n} | {r['workers']} | {r['record_bytes'] / 1e3:.1f} KB | {r['stored_bytes'] / 1e3:.1f} KB | "
              f"{r['plan_bytes'] / 1e3:.1f} KB | {r['incarnations_bytes'] / 1e3:.1f} KB | {r['replay_bytes'] / 1e3:.1f} KB | "
              f"{r['moves']} ({r['moves_bytes'] / 1e3:.1f} KB) | "
              f"{r['bytes_per_node']:.0f} B | {r['decode_ms']:.1f} ms | {r['resolve_ms']:.0f} ms | {r['moves_ms']:.0f} ms | "
              f"{r['halt_bytes']} B | {r['node_fanout_mb']:.1f} MB | {r['fanout_mb']:.0f} MB | "
              f"{r['holder_map_gb']:.2f} GB |", flush=True)


if __name__ == "__main__":
    main()
