"""Reading checkpoints back: the newest complete step, and the committed shards of a step as CPU
tensors, each file checked against its marker's CRC-32 first (`files.py` has the layout).
`torch.distributed.checkpoint` is imported on the first load, not with this module (see
`writers.py`)."""

from __future__ import annotations

from pathlib import Path

import torch

from elastic.engine.checkpoint.files import (
    CheckpointError,
    ShardMarker,
    complete_steps,
    list_steps,
    missing_shards,
    missing_slices,
    read_marker,
    shard_stem,
    step_dir,
    verify_data,
)
from elastic.engine.checkpoint.slices import assemble
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
        named = ", ".join(_missing(directory, step, key) for key in missing)
        raise CheckpointError(
            f"checkpoint step {step} in {directory} lacks committed shards {named}: "
            "their writer did not finish"
        )
    out: Shards = {}
    for key in keys:
        out[key] = _load_one(directory, step, key)
    return out


def _missing(directory: Path, step: int, key: ShardKey) -> str:
    """One shard of `missing_shards`, named: its slices that were not committed, if any."""
    layer, tp_rank = key
    lost = missing_slices(directory, step, key)
    if not lost:
        return f"(layer {layer}, tp {tp_rank})"
    head = read_marker(directory, step, key)
    return f"(layer {layer}, tp {tp_rank}; its slice{'s' * (len(lost) > 1)} " \
           f"{', '.join(map(str, lost))} of {head.slices if head else '?'})"


def shard_metadata(directory: Path, step: int, key: ShardKey) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor of one committed shard, from its DCP metadata alone
    (no tensor is read; a shard written sliced: its head's shapes and its slices' dtypes);
    CheckpointError if the shard is not committed or its metadata is unreadable or disagrees with
    the marker."""
    head = _marker(directory, step, key)
    out = _data_metadata(directory, head)
    if head.slices is None:
        return out
    for marker in slice_markers(directory, head):
        for name, (_, dtype) in _data_metadata(directory, marker).items():
            param = name.partition("/")[2]
            if head.shapes is None or param not in head.shapes:
                raise CheckpointError(f"slice {marker.stem} of step {step} in {directory} holds {name}, "
                                      "which its head does not name")
            out.setdefault(name, (tuple(head.shapes[param]), dtype))
    return out


def _marker(directory: Path, step: int, key: ShardKey) -> ShardMarker:
    marker = read_marker(directory, step, key)
    if marker is None:
        raise CheckpointError(f"shard {shard_stem(key)} of step {step} in {directory} is not committed")
    return marker


def slice_markers(directory: Path, head: ShardMarker) -> list[ShardMarker]:
    """The markers of a head's slices, in order (CheckpointError naming the first missing)."""
    out = []
    for j in range(head.slices or 0):
        marker = read_marker(directory, head.step, ShardKey(head.layer, head.tp_rank), index=j, slices=head.slices or 0)
        if marker is None or marker.index != j or marker.slices != head.slices:
            raise CheckpointError(f"slice {j} of {head.slices} of shard {head.stem} of step {head.step} in "
                                  f"{directory} is not committed: its owner did not finish")
        out.append(marker)
    return out


def _data_metadata(directory: Path, marker: ShardMarker) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of the tensors of one marker's data directory."""
    where = f"{marker.stem} of step {marker.step} in {directory}"
    data = step_dir(directory, marker.step) / marker.data
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


def _read_data(directory: Path, marker: ShardMarker) -> dict[str, torch.Tensor]:
    """The tensors of one marker's data directory, its files checked against their CRC-32 first."""
    verify_data(directory, marker)
    shapes = _data_metadata(directory, marker)
    data = step_dir(directory, marker.step) / marker.data
    tensors = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in shapes.items()}
    import torch.distributed.checkpoint as dcp  # on first use (see the module docstring)

    try:
        dcp.load(tensors, storage_reader=dcp.FileSystemReader(data), no_dist=True)
    except Exception as e:
        raise CheckpointError(f"{marker.stem} of step {marker.step} in {directory}: cannot read {data}: {e}") from e
    return tensors


def _load_one(directory: Path, step: int, key: ShardKey) -> dict[str, torch.Tensor]:
    head = _marker(directory, step, key)
    tensors = _read_data(directory, head)
    if head.slices is None:
        return tensors
    if head.shapes is None or set(tensors) != {"step"}:
        raise CheckpointError(f"shard {head.stem} of step {step} in {directory}: a head needs the shapes and the "
                              f"step count alone, has {sorted(tensors)}")
    slices = [(m.offsets or {}, _read_data(directory, m)) for m in slice_markers(directory, head)]
    return assemble(f"shard {head.stem} of step {step} in {directory}", step=tensors["step"], shapes=head.shapes,
                    slices=slices)
