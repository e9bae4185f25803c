"""A shard holder in its own process: serves `make_shard` shards, stalls after some chunks.

Usage: holder_proc.py TOKEN GENERATION CHUNK_BYTES STALL_AFTER LAYER:TP [LAYER:TP ...]
Prints `PORT <n>` once serving and `PAUSED` when its first stream stalls (the test then
SIGKILLs or SIGSTOPs it).
"""

from __future__ import annotations

import sys
import time

from elastic.transfer.server import ServerConfig, ShardServer
from elastic.transfer.shards import ShardKey
from tests.transfer.faults import FetchReplyInterceptor, StallAfterChunks
from tests.transfer.shard_data import make_shard


def main() -> None:
    token, generation, chunk_bytes, stall_after, *shard_args = sys.argv[1:]
    keys = [ShardKey(*map(int, arg.split(":"))) for arg in shard_args]
    shards = {k: make_shard(*k, numel=1 << 16) for k in keys}
    server = ShardServer(
        ServerConfig(token=token, chunk_bytes=int(chunk_bytes)),
        provider=lambda layer, tp: shards[ShardKey(layer, tp)],
        generation=int(generation),
        interceptors=[FetchReplyInterceptor(StallAfterChunks(int(stall_after)))],
    ).start()
    print(f"PORT {server.port}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
