"""Where an elastic worker entering a generation gets the shards it lacks: the checkpoint the
generation restores (resharded when it was written at another tensor-parallel degree), or the
live holders: over the generation's world group, the moves its record lists (the collective shard
path), then over gRPC from the holders etcd knows of (elastic/roles/holders.py), by shard-server
address, for what those did not bring. `Trainer.start` takes the moves, and the fetch as a
function it calls with what it misses."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from elastic.parallel.shard_moves import moves_of
from elastic.records.generation import GenerationRecord
from elastic.records.job import JobSpec
from elastic.roles.holders import HolderMap
from elastic.roles.worker_log import worker_log
from elastic.transfer.client import FetchConfig, fetch_shards
from elastic.transfer.moves import ShardMove
from elastic.transfer.shards import ShardKey
from elastic.transfer.tls import TlsConfig

Fetch = Callable[[list[ShardKey]], dict[ShardKey, dict[str, torch.Tensor]]]
"""Missing shards -> their tensors."""


def checkpoint_fetch(generation: int, record: GenerationRecord, *, spec: JobSpec, checkpoint_path: str) -> Fetch:
    """For a generation that restores a checkpoint (a fallback, or a resumed run's first): read
    the shards from the checkpoint (the record's directory, else `checkpoint_path`), resharded
    when it was written at another tensor-parallel degree (elastic/engine/checkpoint/reshard.py)."""
    from elastic.engine.checkpoint.reshard import load_resharded

    ckpt = record.restore_checkpoint
    assert ckpt is not None
    directory = Path(record.restore_dir or checkpoint_path)
    cfg, degree = spec.model_config, record.plan.gpus_per_node
    worker_log(f"generation {generation}: restoring from the checkpoint of step {ckpt} in {directory}")

    def fetch(missing: list[ShardKey]) -> dict[ShardKey, dict[str, torch.Tensor]]:
        return load_resharded(directory, ckpt, missing, cfg=cfg, tp_degree=degree)

    return fetch


def collective_moves(record: GenerationRecord) -> list[ShardMove] | None:
    """For the collective shard path: the moves into the generation, as its record lists them (the
    leader plans them only on that path, after the first generation and never for a checkpoint
    restore: elastic/parallel/shard_moves.py). None when the record lists none: what the worker
    misses then comes over gRPC, or from the checkpoint."""
    return None if record.moves is None else moves_of(record.moves, record.plan)


def holder_fetch(
    generation: int, holders: Callable[[], HolderMap], *, token: str, timeout: float, tls: TlsConfig | None,
    exclude: str,
) -> Fetch:
    """For the gRPC shard path: fetch shards from the shard servers of the holder map etcd
    knows (no server is asked what it holds; `exclude`: this worker's own address). A holder
    still resolving its step of the generation before answers "not yet" and is asked again,
    for up to `timeout` (the collective timeout)."""
    config = FetchConfig(token=token, generation=generation, stall_timeout_s=min(30.0, timeout),
                         behind_wait_s=timeout, tls=tls)

    def fetch(missing: list[ShardKey]) -> dict[ShardKey, dict[str, torch.Tensor]]:
        known = holders()
        worker_log(f"generation {generation}: fetching shards {sorted(missing)} over gRPC; holder map read from "
             f"etcd (holdings/ + workers/): {known.describe()}")
        result = fetch_shards(missing, known.by_address(exclude=exclude), config)
        worker_log(f"generation {generation}: fetched {len(result.shards)} shards over gRPC "
             f"({result.bytes_moved} B) from {result.bytes_by_holder} in {result.seconds:.3f} s")
        return dict(result.shards)

    return fetch
