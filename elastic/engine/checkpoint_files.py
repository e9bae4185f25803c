"""On-disk layout of checkpoints: step directories, per-shard data directories and markers.

    <directory>/step-<step:08d>/                 one optimizer step
        layer-<LLLL>-tp-<TT>.<token>/            one shard's data, written by torch.distributed.checkpoint
        layer-<LLLL>-tp-<TT>.done                marker: JSON naming the data directory, written last

Every write of a shard goes to a fresh data directory (unique token), and the marker is written
to a temporary name, fsynced and renamed over the final name: the rename is the commit point. A
writer killed at any moment therefore leaves either no marker (the shard does not count) or the
previous marker (pointing to data that is still whole). A step is complete when the marker of
every (layer, tp_rank) of the model exists.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path

from elastic.transfer.shards import ShardKey

_STEP_RE = re.compile(r"^step-(\d{8})$")
MARKER_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that was asked for does not exist, is incomplete or is unreadable."""


def step_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}"


def shard_stem(key: ShardKey) -> str:
    layer, tp_rank = key
    return f"layer-{layer:04d}-tp-{tp_rank:02d}"


def marker_path(directory: Path, step: int, key: ShardKey) -> Path:
    return step_dir(directory, step) / f"{shard_stem(key)}.done"


def new_data_dir(directory: Path, step: int, key: ShardKey) -> Path:
    """A data directory name no earlier write of this shard has used."""
    return step_dir(directory, step) / f"{shard_stem(key)}.{uuid.uuid4().hex[:12]}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(directory: Path, step: int, key: ShardKey, data_dir: Path, names: list[str]) -> None:
    """Commit one shard: temp file, fsync, atomic rename, fsync of the step directory."""
    final = marker_path(directory, step, key)
    body = {
        "version": MARKER_VERSION,
        "step": step,
        "layer": key[0],
        "tp_rank": key[1],
        "data": data_dir.name,
        "names": sorted(names),
    }
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(body, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def read_marker(directory: Path, step: int, key: ShardKey) -> dict[str, object] | None:
    """The marker of one shard, or None when the shard was never committed."""
    path = marker_path(directory, step, key)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:  # cannot happen with an atomic rename, but say so if it does
        raise CheckpointError(f"marker {path} is not valid JSON: {e}") from e
    if not isinstance(body, dict) or body.get("version") != MARKER_VERSION:
        raise CheckpointError(f"marker {path} has an unknown format: {text[:200]!r}")
    return body


def list_steps(directory: Path) -> list[int]:
    """Every step that has a directory (complete or not), ascending."""
    if not directory.is_dir():
        return []
    out = []
    for entry in directory.iterdir():
        m = _STEP_RE.match(entry.name)
        if m and entry.is_dir():
            out.append(int(m.group(1)))
    return sorted(out)


def all_keys(num_layers: int, tp_degree: int) -> list[ShardKey]:
    if num_layers < 1 or tp_degree < 1:
        raise ValueError(f"num_layers and tp_degree must be >= 1, got {num_layers} and {tp_degree}")
    return [ShardKey(layer, t) for layer in range(num_layers) for t in range(tp_degree)]


def missing_shards(directory: Path, step: int, keys: list[ShardKey]) -> list[ShardKey]:
    """The shards of `keys` that have no marker in `step`."""
    return [k for k in keys if not marker_path(directory, step, k).is_file()]


def complete_steps(directory: Path, *, num_layers: int, tp_degree: int) -> list[int]:
    """Steps whose every (layer, tp_rank) is committed, ascending."""
    keys = all_keys(num_layers, tp_degree)
    return [s for s in list_steps(directory) if not missing_shards(directory, s, keys)]


def prune(directory: Path, *, num_layers: int, tp_degree: int, keep: int) -> list[int]:
    """Delete every step older than the `keep` newest complete ones (complete or partial).

    Several writers may prune at once: a step is first renamed to a hidden name (atomic, only
    one renamer wins), then removed. Returns the steps this call removed.
    """
    complete = complete_steps(directory, num_layers=num_layers, tp_degree=tp_degree)
    if len(complete) <= keep:
        return []
    oldest_kept = complete[-keep]
    removed = []
    for s in list_steps(directory):
        if s >= oldest_kept:
            continue
        trash = directory / f".trash-step-{s:08d}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(step_dir(directory, s), trash)
        except OSError:
            continue  # another writer pruned it first
        with contextlib.suppress(OSError):
            shutil.rmtree(trash)
        removed.append(s)
    return removed
