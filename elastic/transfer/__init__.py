"""Shard transfer: move named tensors (a layer shard's parameters and optimizer state) between
workers: over the new generation's process group (`collective`), or over gRPC in checksummed
chunks without pickling (everything else, and the fallback).

- `codec`: tensor <-> header + raw bytes chunks, CRC-32 verification.
- `shards`: `ShardKey`, and `assign_shards`: which shard to fetch from which holder (a
  `FetchAssignment`).
- `server`: `ShardServer`, serving shards from a provider callable.
- `wire`: the Fetch stream's data chunks framed by hand (protobuf-identical bytes, fewer copies).
- `stream`: `ShardStreamParser`, one Fetch reply stream -> verified tensors.
- `client`: `fetch_shards` (spread, verify, re-fetch) from a holder map the caller gives.
- `moves`: `ShardMove` and `assign_moves` (which rank sends which shard to which); no torch.
- `collective`: `exchange`, which carries moves out: grouped
  point-to-point operations on a generation's communicator (gloo or NCCL, NCCL's rules kept),
  each tensor verified by a vectorised checksum.
- `codegen`: regenerates the committed gRPC stubs from `proto/shard_transfer.proto`.

Model-agnostic: it knows tensor names and (layer, tp_rank) keys, nothing of the GPT or the plan.

The package exports nothing of its own: import from the module that defines a name
(`from elastic.transfer.shards import ShardKey`), so every import is an edge that tools and
tests/test_layers.py can follow. `shards` and `moves` import no torch: the control plane (agents, the
leader) imports it without paying for torch.
"""
