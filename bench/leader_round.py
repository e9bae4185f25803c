"""Issue 34: what the leader reads once every sync report of a change is in, at W workers.

    .venv/bin/python bench/leader_round.py [--nodes 128 512 2048] [--gpus 8] [--repeats 5] [--forms worker node] [--json out.json]

A fresh etcd (127.0.0.1) holds one generation's sync reports (a vote each) and every worker's
holdings (3 layers each), written as the nodes' relays write them, in one of two forms: one key
a worker of each (`worker`, until issue 34's node records) or one a node (`node`,
`sync/<g>/<node>/all` and `holdings/<node>/all`, elastic/records/node_sync.py and
node_holdings.py, what the runtime writes now). Then, timed
on this otherwise idle process (median of `--repeats`):

- baseline: the reports read and decoded all at once, as the leader did until the sync mirror
  (a count of the keys, then one range read and a decode each);
- mirror: the leader's `sync_reports` over its `PrefixMirror` of `sync/`, which decoded each report
  when its watch delivered it (elastic/roles/leader.py): what is left for the round that finds
  the last one;
- the holdings read (`read_holdings`), which the round still makes once the reports are complete;
- the decode alone, for scale: the CPU the mirror moves off the round, onto the watch's thread
  while the reports arrive.

Not the whole round: members, the halt, the last step's decision and the re-plan are O(nodes)
and small beside these at W = 16,384 (the re-plan: bench/planning_scale.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.coordinator import EtcdConfig, EtcdServer, connect  # noqa: E402
from elastic.coordinator.keys import JobKeys, RunKeys  # noqa: E402
from elastic.coordinator.prefix_mirror import PrefixMirror  # noqa: E402
from elastic.records.generation import Vote  # noqa: E402
from elastic.records.node_holdings import NodeHoldings, node_holdings_key  # noqa: E402
from elastic.records.node_sync import NodeSyncReports, reports_of  # noqa: E402
from elastic.records.sync import SyncReport  # noqa: E402
from elastic.roles.etcd_writes import Put, write_puts  # noqa: E402
from elastic.roles.holders import read_holdings  # noqa: E402
from elastic.roles.leader_sync import read_sync_reports, sync_reports  # noqa: E402

GENERATION = 3


def _timed(f: Callable[[], Any], repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _baseline(client: Any, rk: RunKeys, expected: set[tuple[int, int]]) -> list[SyncReport] | None:
    """The reports read and decoded at once (the leader's read before the mirror, and its
    fallback when the mirror lacks some that etcd has)."""
    if int(client.get_prefix_response(rk.sync(GENERATION), count_only=True).count) < len({n for n, _ in expected}):
        return None
    return read_sync_reports(client, rk, GENERATION, expected)


def one(nodes: int, gpus: int, repeats: int, form: str = "node") -> dict[str, Any]:
    with EtcdServer() as server:
        client = connect(EtcdConfig(endpoint=server.endpoint))
        try:
            rk = RunKeys(JobKeys("leader-round"))
            vote = Vote(step=499, grad_norm=1.0, loss=2.0)
            for n in range(nodes):
                puts: list[Put] = []
                reports = [SyncReport(committed=500, pending=None, last_vote=vote, node=n, local_rank=lr)
                           for lr in range(gpus)]
                held = {r.local_rank: [(layer, r.local_rank) for layer in range(3)] for r in reports}
                for r in reports:
                    if form == "worker":
                        puts.append((rk.sync_report(GENERATION, n, r.local_rank), r.to_json(), None))
                        puts.append((rk.worker_holdings(n, r.local_rank), json.dumps(held[r.local_rank]), None))
                if form == "node":
                    puts.append((rk.node_sync(GENERATION, n), NodeSyncReports.of(reports).to_json(), None))
                    puts.append((node_holdings_key(rk, n), NodeHoldings(node=n, held=held).to_json(), None))
                write_puts(client, puts)
            expected = {(n, lr) for n in range(nodes) for lr in range(gpus)}
            raw = [v for v, _ in client.get_prefix(rk.sync(GENERATION))]
            mirror = PrefixMirror(client, rk.prefix("sync"), reports_of)
            try:
                picked = sync_reports(client, rk, mirror, GENERATION, expected)
                assert picked is not None and len(picked) == len(expected), "the mirror lacks reports"
                assert picked == _baseline(client, rk, expected)
                row = {
                    "workers": nodes * gpus, "nodes": nodes, "form": form,
                    "baseline_s": _timed(lambda: _baseline(client, rk, expected), repeats),
                    "mirror_s": _timed(lambda: sync_reports(client, rk, mirror, GENERATION, expected), repeats),
                    "holdings_s": _timed(lambda: read_holdings(client, rk), repeats),
                    "decode_s": _timed(lambda: [reports_of(v) for v in raw], repeats),
                    "reports_bytes": sum(len(v) for v in raw),
                }
            finally:
                mirror.close()
        finally:
            client.close()
    row["ratio"] = row["mirror_s"] / row["baseline_s"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--gpus", type=int, default=8, help="workers a node")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--forms", nargs="+", choices=["worker", "node"], default=["worker", "node"],
                   help="the sync reports' keys: one a worker, one a node")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = p.parse_args(argv)
    rows = [one(n, args.gpus, args.repeats, form) for n in args.nodes for form in args.forms]
    print(f"{'W':>7} {'nodes':>6} {'form':>6} {'baseline s':>11} {'mirror s':>9} {'ratio':>7} {'holdings s':>11} "
          f"{'decode s':>9} {'reports MB':>11}")
    for r in rows:
        print(f"{r['workers']:>7} {r['nodes']:>6} {r['form']:>6} {r['baseline_s']:>11.3f} {r['mirror_s']:>9.3f} {r['ratio']:>7.3f} "
              f"{r['holdings_s']:>11.3f} {r['decode_s']:>9.3f} {r['reports_bytes'] / 1e6:>11.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
