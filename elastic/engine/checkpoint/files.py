"""On-disk layout of checkpoints: step directories, per-shard data directories and markers.

    <directory>/step-<step:08d>/                 one optimizer step
        layer-<LLLL>-tp-<TT>.<token>/            one shard's data, written by torch.distributed.checkpoint
        layer-<LLLL>-tp-<TT>.done                marker: JSON naming the data directory, written last
        layer-<LLLL>-tp-<TT>-slice-<J>-of-<S>.*  with the optimizer sharded: one slice of the
                                                 shard, data and marker (`slices.py`)

Every write of a shard goes to a fresh data directory (unique token), and the marker is written
to a temporary name, fsynced and renamed over the final name: the rename is the commit point. A
writer killed at any moment therefore leaves either no marker (the shard does not count) or the
previous marker (pointing to data that is still whole). A step is complete when the marker of
every (layer, tp_rank) of the model exists.

The marker (`ShardMarker`, version 2) also names the model's layer count and tensor-parallel
degree, so a step directory describes itself (a resumed run reshards it), and the CRC-32 of
every file of the data directory, so a reader detects a corrupt shard before it uses it.
Version-1 markers (no degree, no checksums) are still read; their shards are not verified.
Version 3 is the sharded optimizer's: a head (the shard's AdamW step count, its parameters'
shapes and its slice count) and one marker per slice (`slices.py`); a step is complete only when
every slice of every head is committed too.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

from elastic.coordinator.jsonrecord import JsonRecord, RecordError
from elastic.transfer.shards import ShardKey

_STEP_RE = re.compile(r"^step-(\d{8})$")
_MARKER_RE = re.compile(r"^layer-(\d{4})-tp-(\d{2})\.done$")
MARKER_VERSION = 3
WHOLE_VERSION = 2
"""The version of a marker of a shard written whole (what readers before version 3 read)."""
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that was asked for does not exist, is incomplete or is unreadable."""


@dataclass(frozen=True, kw_only=True)
class ShardMarker(JsonRecord):
    """The commit record of one shard of one step: where its data is and how to check it."""

    step: int
    """Optimizer step the shard belongs to (the number of committed steps)."""
    layer: int
    """Planning layer of the shard."""
    tp_rank: int
    """Tensor-parallel rank of the shard."""
    data: str
    """Name of the shard's data directory (torch.distributed.checkpoint files) in the step's directory."""
    names: list[str]
    """Sorted tensor names in the data directory."""
    num_layers: int | None = None
    """Planning layers of the model that wrote it (None: a version-1 marker)."""
    tp_degree: int | None = None
    """Tensor-parallel degree of the run that wrote it (None: a version-1 marker)."""
    checksums: dict[str, int] | None = None
    """CRC-32 of every file of the data directory, by relative path (None: a version-1 marker,
    not verified)."""
    slices: int | None = None
    """Version 3, a head or a slice: the number of slices the shard was written in."""
    index: int | None = None
    """Version 3, a slice: its number, 0 to `slices` - 1 (None: a head or a whole shard)."""
    shapes: dict[str, list[int]] | None = None
    """Version 3, a head: the shape of each parameter of the shard, by canonical name."""
    offsets: dict[str, int] | None = None
    """Version 3, a slice: the first element (flattened) of each parameter it holds part of."""
    version: int = WHOLE_VERSION
    """Marker format: 1 (data and names only), 2 (with the model's layers and degree, and
    checksums) or 3 (a head or a slice of a shard written sliced). The field predates the JSON
    records' schema version and stays the marker's own."""

    @property
    def stem(self) -> str:
        """The name of its marker file without `.done`."""
        key = ShardKey(self.layer, self.tp_rank)
        return shard_stem(key) if self.index is None else slice_stem(key, self.index, self.slices or 0)


def step_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}"


def shard_stem(key: ShardKey) -> str:
    layer, tp_rank = key
    return f"layer-{layer:04d}-tp-{tp_rank:02d}"


def slice_stem(key: ShardKey, index: int, slices: int) -> str:
    """The name of slice `index` of `slices` of a shard (its data directory's and marker's)."""
    return f"{shard_stem(key)}-slice-{index:03d}-of-{slices:03d}"


def marker_path(directory: Path, step: int, key: ShardKey, *, index: int | None = None, slices: int = 0) -> Path:
    """The marker of one shard, or of its slice `index` of `slices`."""
    stem = shard_stem(key) if index is None else slice_stem(key, index, slices)
    return step_dir(directory, step) / f"{stem}.done"


def new_data_dir(directory: Path, step: int, stem: str) -> Path:
    """A data directory name no earlier write of this shard (or slice: `stem`) has used."""
    return step_dir(directory, step) / f"{stem}.{uuid.uuid4().hex[:12]}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_crc32(path: Path) -> int:
    """CRC-32 of a file's bytes, read in chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def data_checksums(data_dir: Path) -> dict[str, int]:
    """CRC-32 of every file under a shard's data directory, by path relative to it."""
    return {p.relative_to(data_dir).as_posix(): file_crc32(p) for p in sorted(data_dir.rglob("*")) if p.is_file()}


def write_marker(directory: Path, marker: ShardMarker, data_dir: Path) -> None:
    """Commit one shard or slice (`marker`, its `data` and `checksums` filled in here from
    `data_dir`): checksums of its data, temp file, fsync, atomic rename, fsync of the step
    directory."""
    marker = replace(marker, data=data_dir.name, names=sorted(marker.names), checksums=data_checksums(data_dir))
    final = marker_path(directory, marker.step, ShardKey(marker.layer, marker.tp_rank), index=marker.index,
                        slices=marker.slices or 0)
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(marker.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:  # a full disk: leave no temporary marker behind
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(final.parent)


def read_marker(directory: Path, step: int, key: ShardKey, *, index: int | None = None,
                slices: int = 0) -> ShardMarker | None:
    """The marker of one shard (or of its slice `index` of `slices`), or None when it was never
    committed (CheckpointError when it cannot be read)."""
    path = marker_path(directory, step, key, index=index, slices=slices)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"marker {path} is not text: {e}") from e
    try:
        marker = ShardMarker.from_json(text)
    except RecordError as e:  # cannot happen with an atomic rename, but say so if it does
        raise CheckpointError(f"marker {path} has an unknown format ({e}): {text[:200]!r}") from e
    if not 1 <= marker.version <= MARKER_VERSION:
        raise CheckpointError(f"marker {path} has an unknown format version {marker.version}")
    return marker


def verify_data(directory: Path, marker: ShardMarker) -> None:
    """CheckpointError unless every file of the marker's data directory has its recorded CRC-32
    (and no recorded file is missing); a version-1 marker has nothing to verify."""
    if marker.checksums is None:
        return
    data = step_dir(directory, marker.step) / marker.data
    where = f"{'shard' if marker.index is None else 'slice'} {marker.stem} of step {marker.step} in {directory}"
    for rel, want in sorted(marker.checksums.items()):
        path = data / rel
        try:
            got = file_crc32(path)
        except OSError as e:
            raise CheckpointError(f"{where} is corrupt: cannot read {path}: {e.strerror}") from e
        if got != want:
            raise CheckpointError(f"{where} is corrupt: {path} has CRC-32 {got:08x}, its marker says {want:08x}")


def committed_keys(directory: Path, step: int) -> list[ShardKey]:
    """The (layer, tp_rank) of every marker in `step`'s directory, ascending."""
    d = step_dir(directory, step)
    if not d.is_dir():
        return []
    found = (_MARKER_RE.match(p.name) for p in d.iterdir())
    return sorted(ShardKey(int(m.group(1)), int(m.group(2))) for m in found if m)


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
    """The shards of `keys` that have no marker in `step`, or whose head names a slice that has
    none (an unreadable head counts as present: its reader says what is wrong)."""
    return [k for k in keys if not marker_path(directory, step, k).is_file() or missing_slices(directory, step, k)]


def missing_slices(directory: Path, step: int, key: ShardKey) -> list[int]:
    """The slices of a shard written sliced that have no marker in `step` (none for a shard
    written whole, or one whose head is missing or cannot be read)."""
    try:
        head = read_marker(directory, step, key)
    except CheckpointError:
        return []
    if head is None or head.slices is None or head.index is not None:
        return []
    return [j for j in range(head.slices) if not marker_path(directory, step, key, index=j, slices=head.slices).is_file()]


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
