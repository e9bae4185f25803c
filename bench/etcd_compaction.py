"""etcd's db size after many steps of one `progress` put each, with and without auto-compaction.

Starts a private etcd (elastic.coordinator.EtcdServer) with the given auto-compaction flags,
overwrites one key with a `--value-bytes` value `--puts` times at `--rate` puts a second (a
training job's step rate; 0: as fast as possible), then waits `--settle` seconds and prints the
db size (`client.status().db_size`, the file) and the bytes in use (`dbSizeInUse`), sampled
every `--every` puts as it goes:

    .venv/bin/python bench/etcd_compaction.py --puts 3000 --rate 20
    .venv/bin/python bench/etcd_compaction.py --puts 3000 --rate 20 --mode off
    .venv/bin/python bench/etcd_compaction.py --puts 3000 --rate 0 --mode revision --retention 100
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from etcd3 import etcdrpc  # noqa: E402

from elastic.coordinator.client import EtcdConfig, connect  # noqa: E402
from elastic.coordinator.etcd_server import EtcdServer  # noqa: E402


def sizes(client: Any, endpoint: str) -> tuple[int, int, int]:
    """(db file bytes, db bytes in use, revision) of the etcd at `endpoint` (`client` talks to it).

    The file size is the status API's `db_size`; python-etcd3's protobufs predate `dbSizeInUse`,
    so the bytes in use come from etcd's own metrics page."""
    stub = etcdrpc.MaintenanceStub(client.channel)
    resp = stub.Status(etcdrpc.StatusRequest(), credentials=client.call_credentials, metadata=client.metadata)
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5.0) as page:
        text = page.read().decode()
    in_use = next(float(line.split()[1]) for line in text.splitlines()
                  if line.startswith("etcd_mvcc_db_total_size_in_use_in_bytes "))
    return int(resp.dbSize), int(in_use), int(resp.header.revision)


def run(puts: int, value_bytes: int, rate: float, mode: str, retention: str, every: int, settle: float) -> dict[str, Any]:
    """Drive one etcd and return what was measured."""
    compaction = None if mode == "off" else (mode, retention)
    samples: list[dict[str, float]] = []
    with EtcdServer(auto_compaction=compaction) as server:
        client = connect(EtcdConfig(endpoint=server.endpoint))
        value = "x" * value_bytes
        start = time.monotonic()
        for i in range(1, puts + 1):
            client.put("/elastic/bench/progress", value)
            if rate > 0:
                time.sleep(max(0.0, start + i / rate - time.monotonic()))
            if i % every == 0:
                db, in_use, rev = sizes(client, server.endpoint)
                samples.append({"puts": i, "db_size": db, "db_in_use": in_use, "revision": rev,
                                "seconds": round(time.monotonic() - start, 1)})
                print(json.dumps(samples[-1]), flush=True)
        time.sleep(settle)
        db, in_use, rev = sizes(client, server.endpoint)
        client.close()
    return {"puts": puts, "value_bytes": value_bytes, "rate": rate, "auto_compaction": compaction,
            "db_size": db, "db_in_use": in_use, "revision": rev, "max_db_size": max([db] + [int(s["db_size"]) for s in samples]),
            "samples": samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--puts", type=int, default=3000)
    ap.add_argument("--value-bytes", type=int, default=400)
    ap.add_argument("--rate", type=float, default=20.0, help="puts per second (0: unpaced)")
    ap.add_argument("--mode", choices=("periodic", "revision", "off"), default="periodic")
    ap.add_argument("--retention", default="1m", help="--auto-compaction-retention (periodic: a duration)")
    ap.add_argument("--every", type=int, default=500, help="sample the db size every this many puts")
    ap.add_argument("--settle", type=float, default=0.0, help="seconds to wait after the last put")
    args = ap.parse_args()
    out = run(args.puts, args.value_bytes, args.rate, args.mode, args.retention, args.every, args.settle)
    del out["samples"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
