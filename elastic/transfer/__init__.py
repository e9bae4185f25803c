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
- `collective`: `assign_moves` (which rank sends which shard to which) and `exchange`: grouped
  point-to-point operations on a generation's communicator (gloo or NCCL, NCCL's rules kept),
  each tensor verified by a vectorised checksum.
- `codegen`: regenerates the committed gRPC stubs from `proto/shard_transfer.proto`.

Model-agnostic: it knows tensor names and (layer, tp_rank) keys, nothing of the GPT or the plan.

The names below are imported on first use (PEP 562): the control plane (agents, the leader)
imports `elastic.transfer.shards` through this package without paying for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names for type checkers; `_HOME` says where each one lives at run time
    from elastic.transfer.client import (  # noqa: F401
        FetchConfig,
        FetchResult,
        GenerationBehind,
        HolderBusy,
        TransferError,
        fetch_shards,
    )
    from elastic.transfer.codec import CorruptTensorError  # noqa: F401
    from elastic.transfer.collective import CollectiveResult, ShardMove, assign_moves, exchange  # noqa: F401
    from elastic.transfer.server import ServerConfig, ShardProvider, ShardServer  # noqa: F401
    from elastic.transfer.shards import FetchAssignment, ShardKey, assign_shards  # noqa: F401
    from elastic.transfer.stream import ShardCheck, ShardStreamParser  # noqa: F401

_HOME = {
    "FetchConfig": "client",
    "FetchResult": "client",
    "GenerationBehind": "client",
    "HolderBusy": "client",
    "TransferError": "client",
    "fetch_shards": "client",
    "CorruptTensorError": "codec",
    "CollectiveResult": "collective",
    "ShardMove": "collective",
    "assign_moves": "collective",
    "exchange": "collective",
    "ServerConfig": "server",
    "ShardProvider": "server",
    "ShardServer": "server",
    "FetchAssignment": "shards",
    "ShardKey": "shards",
    "assign_shards": "shards",
    "ShardCheck": "stream",
    "ShardStreamParser": "stream",
}
"""Exported name -> the submodule that defines it."""

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
