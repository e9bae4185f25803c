"""A process that floods one worker's shard server with requests carrying the valid job token:
`threads` concurrent streams asking for every shard the worker holds, for a nonexistent shard,
and for more shards than a request may name, following the job's generation. It stops when
`stop_file` appears and prints one JSON line: the status codes it got, by name, with counts.

    python -m tests.faults.flood_proc ETCD JOB TOKEN NODE STOP_FILE [THREADS]
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from elastic.coordinator import EtcdConfig, JobKeys, connect
from elastic.coordinator.keys import RunKeys
from elastic.records.node_workers import read_registrations
from elastic.transfer import shard_transfer_pb2 as pb
from elastic.transfer import shard_transfer_pb2_grpc as pb_grpc


class Flood:
    """The flooding loop of one process (module doc)."""

    def __init__(self, etcd: str, job: str, token: str, node: int, stop_file: Path) -> None:
        self.client = connect(EtcdConfig(endpoint=etcd))
        self.keys, self.token, self.node, self.stop_file = JobKeys(job), token, node, stop_file
        self.rk = RunKeys(self.keys)
        self.outcomes: Counter[str] = Counter()
        self.lock = threading.Lock()

    def target(self) -> tuple[str, int] | None:
        """The worker's transfer address and the job's generation now (None: not there yet)."""
        info = read_registrations(self.client, self.rk, node=self.node).get((self.node, 0))
        generation, _ = self.client.get(self.keys.generation)
        if info is None or generation is None:
            return None
        return info.transfer_address, int(generation)

    def run_thread(self, index: int) -> None:
        kinds = ["held", "held", "held", "missing", "too-many"]
        i = index
        while not self.stop_file.exists():
            where = self.target()
            if where is None:
                time.sleep(0.05)
                continue
            address, generation = where
            kind = kinds[i % len(kinds)]
            i += 1
            layers = {"held": range(3), "missing": [999], "too-many": range(2000)}[kind]
            request = pb.FetchRequest(credentials=pb.Credentials(token=self.token, generation=generation),
                                      shards=[pb.ShardId(layer=layer, tp_rank=0) for layer in layers])
            with grpc.insecure_channel(address) as channel:
                try:
                    for _ in pb_grpc.ShardTransferStub(channel).Fetch(request, timeout=10):
                        pass
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
            with self.lock:
                self.outcomes[f"{kind}:{code}"] += 1


def main(argv: list[str]) -> None:
    etcd, job, token, node, stop_file = argv[:5]
    threads = int(argv[5]) if len(argv) > 5 else 16
    flood = Flood(etcd, job, token, int(node), Path(stop_file))
    workers = [threading.Thread(target=flood.run_thread, args=(i,), daemon=True) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    print(json.dumps(dict(flood.outcomes)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
