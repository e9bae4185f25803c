"""Reading checkpoints back: the newest complete step, and the committed shards of a step as CPU
tensors, each file checked against its marker's CRC-32 first (`files.py` has the layout).
`torch.distributed.checkpoint` is imported on the first load, not with this module (see
`writers.py`)."""

from __future__ import annotations

from pathlib import Path

import torch

from elastic.engine.checkpoint.files import (
    CheckpointError,
    complete_steps,
    list_steps,
    missing_shards,
    read_marker,
    shard_stem,
    step_dir,
    verify_data,
)
from elastic.engine.checkpoint.writers import Shards
from elastic.transfer.shards import ShardKey


def latest_complete(directory: Path, *, num_layers: int, tp_degree: int) -> int | None:
    """The newest step whose every (layer, tp_rank) shard is committed, or None."""
    steps = complete_steps(Path(directory), num_layers=num_layers, tp_degree=tp_degree)
    return steps[-1] if steps else None


def load_shards(directory: Path, step: int, keys: list[ShardKey]) -> Shards:
    """The committed shards `keys` of `step`, as CPU tensors named like `Trainer.export_shard`;
    every file is checked against its marker's CRC-32 first (CheckpointError if corrupt)."""
    directory = Path(directory)
    if not step_dir(directory, step).is_dir():
        present = list_steps(directory)
        raise CheckpointError(
            f"no checkpoint of step {step} in {directory} (steps present: {present or 'none'})"
        )
    missing = missing_shards(directory, step, keys)
    if missing:
        named = ", ".join(f"(layer {layer}, tp {t})" for layer, t in missing)
        raise CheckpointError(
            f"checkpoint step {step} in {directory} lacks committed shards {named}: "
            "their writer did not finish"
        )
    out: Shards = {}
    for key in keys:
        out[key] = _load_one(directory, step, key)
    return out


def shard_metadata(directory: Path, step: int, key: ShardKey) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor of one committed shard, from its DCP metadata alone
    (no tensor is read); CheckpointError if the shard is not committed or its metadata is unreadable
    or disagrees with the marker."""
    marker = read_marker(directory, step, key)
    where = f"shard {shard_stem(key)} of step {step} in {directory}"
    if marker is None:
        raise CheckpointError(f"{where} is not committed")
    data = step_dir(directory, step) / marker.data
    import torch.distributed.checkpoint as dcp  # on first use (see the module docstring)

    try:
        metadata = dcp.FileSystemReader(data).read_metadata().state_dict_metadata
    except Exception as e:
        raise CheckpointError(f"{where}: cannot read {data}: {e}") from e
    if sorted(metadata) != marker.names:
        raise CheckpointError(f"{where}: tensors {sorted(metadata)} differ from the marker's {marker.names}")
    out = {}
    for name, meta in metadata.items():
        if not isinstance(meta, dcp.TensorStorageMetadata):
            raise CheckpointError(f"{where}: entry {name!r} is not a tensor")
        out[name] = (tuple(meta.size), meta.properties.dtype)
    return out


def _load_one(directory: Path, step: int, key: ShardKey) -> dict[str, torch.Tensor]:
    marker = read_marker(directory, step, key)
    assert marker is not None  # checked by the caller
    verify_data(directory, marker)
    shapes = shard_metadata(directory, step, key)
    data = step_dir(directory, step) / marker.data
    tensors = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in shapes.items()}
    import torch.distributed.checkpoint as dcp  # on first use (see the module docstring)

    try:
        dcp.load(tensors, storage_reader=dcp.FileSystemReader(data), no_dist=True)
    except Exception as e:
        raise CheckpointError(f"shard {shard_stem(key)} of step {step} in {directory}: cannot read {data}: {e}") from e
    return tensors
