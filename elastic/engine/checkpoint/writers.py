"""The checkpoint writer: asynchronous sharded checkpoints, the fallback when a layer has no
surviving holder.

Shards are the dicts `Trainer.export_shard` serves: `{(layer, tp_rank): {name: tensor}}` with
names `param/<canonical>`, `exp_avg/<canonical>`, `exp_avg_sq/<canonical>` and `step`. Every
shard is written by exactly one worker (`checkpoint_writer_shards`), each with its own
`torch.distributed.checkpoint` save in single-process mode: no process group is involved, so a
checkpoint never waits on a peer and survives any peer's failure. The training thread only pays
for a copy of the tensors; the write, fsync and commit marker happen on a background thread.
See `files.py` for the on-disk layout and why a partly written step never counts.

A save that fails (a full or failing disk: ENOSPC, any OSError, or torch's RuntimeError for a
short write) removes its partial data directory, writes no marker and does not stop the writer:
`take_failures()` hands each such `FailedSave` to the training thread once, to report. Only a
missing checkpoint directory (a configuration error) surfaces as CheckpointError on `flush`.

The writer holds one step being written and at most one waiting: a save made while one waits
first waits for the writer to start on it (`SaveRecord.waited_s`). A disk slower than the
checkpoint interval then slows training by the difference, as torchtitan's and Megatron's
asynchronous saves wait for the one before; it no longer costs a host copy a queued step, nor a
lag that grows step by step (under load an unbounded queue once fell 7 steps behind, and a
fallback found no complete checkpoint). Every due step is still written, unless the wait passes
`max_wait_s` (a stalled disk): that step is then skipped, and reported as a failed save, so a
hung disk costs checkpoints, not the training.

`torch.distributed.checkpoint` is imported by the writer's background thread as it starts, or by
the first load (`load.py`), not when this module is imported: it pulls in DTensor and sympy,
about 0.5 s of CPU that a worker would otherwise spend before it can register, on every start
and every rejoin.
A worker starts the thread at once (`warm()`), so the import overlaps its wait for a generation
and the first save does not pay for it.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from elastic.comm.device import host_copy, mark, settle
from elastic.engine.checkpoint.files import (
    MARKER_VERSION,
    CheckpointError,
    ShardMarker,
    all_keys,
    complete_steps,
    new_data_dir,
    prune,
    step_dir,
    write_marker,
)
from elastic.engine.checkpoint.slices import CheckpointPart
from elastic.transfer.shards import ShardKey

Shards = dict[ShardKey, dict[str, torch.Tensor]]
"""Shard -> its tensors by name, as `Trainer.export_shard` serves them."""

# Single-process saves and loads are the intent here (one writer per shard, no process group);
# torch warns about it on every call.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
)


MAX_WAIT_S = 60.0
"""A save that waited this long for the writer to start on the step before is skipped (module doc)."""


@dataclass(frozen=True, kw_only=True)
class SaveRecord:
    """What one `save_async` cost, for benchmarks and logs."""

    step: int
    """Step the shards belong to."""
    shards: int
    """Number of parts written: whole (layer, tp_rank) shards, or heads and slices of sliced ones."""
    bytes: int
    """Tensor bytes written."""
    copy_s: float
    """Seconds `save_async` spent on the calling (training) thread copying."""
    waited_s: float
    """Seconds it waited before, for the writer to start on the step saved before (module doc)."""
    write_s: float
    """Seconds the background thread spent writing, syncing and committing."""


@dataclass(frozen=True, kw_only=True)
class FailedSave:
    """A save that could not be written (a full or failing disk): training goes on without it."""

    step: int
    """Step whose shards were not saved; it left no marker, so it never counts as complete."""
    reason: str
    """The OSError's message (e.g. `[Errno 28] No space left on device`), naming the file when known."""


@dataclass(frozen=True)
class _Job:
    step: int
    parts: list[CheckpointPart]
    copy_s: float
    waited_s: float
    ready: Any = None
    """CUDA: the event after the copies into pinned host memory, waited for by the writer
    thread (None on CPU: the copies are done)."""


class _Slot:
    """The writer thread's work: the job being written and at most one waiting (module doc)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._waiting: _Job | None = None
        self._busy = False
        self._closed = False

    def wait_free(self, timeout: float) -> _Job | None:
        """Wait until no job waits (the writer has started on the last one put), `timeout`
        seconds at most; the job still waiting then, else None. One thread puts, so a free slot
        stays free until its `put`."""
        with self._cv:
            self._cv.wait_for(lambda: self._waiting is None, timeout=timeout)
            return self._waiting

    def put(self, job: _Job) -> None:
        with self._cv:
            if self._waiting is not None:
                raise RuntimeError("a checkpoint job already waits: put after wait_free, from one thread")
            self._waiting = job
            self._cv.notify_all()

    def take(self) -> _Job | None:
        """The next job to write (the writer is busy until `done`); None once closed and empty."""
        with self._cv:
            while self._waiting is None and not self._closed:
                self._cv.wait()
            job, self._waiting = self._waiting, None
            self._busy = job is not None
            self._cv.notify_all()
            return job

    def done(self) -> None:
        with self._cv:
            self._busy = False
            self._cv.notify_all()

    def drain(self) -> None:
        """Wait until no job waits and none is being written."""
        with self._cv:
            while self._busy or self._waiting is not None:
                self._cv.wait()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class CheckpointWriter:
    """Writes this worker's shards of a step in the background; one writer per worker process."""

    def __init__(self, directory: Path, *, num_layers: int, tp_degree: int, keep: int = 2,
                 max_wait_s: float = MAX_WAIT_S) -> None:
        all_keys(num_layers, tp_degree)  # validates both
        if keep < 1:
            raise ValueError(f"keep must be >= 1 complete checkpoint, got {keep}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.max_wait_s = max_wait_s
        """The longest a save waits for the writer before it is skipped (module doc)."""
        self.directory = Path(directory)
        self.num_layers = num_layers
        self.tp_degree = tp_degree
        self.keep = keep
        self.records: list[SaveRecord] = []
        """One record per finished `save_async`, in order."""
        self._failed: list[FailedSave] = []
        self._slot = _Slot()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ---- training thread -----------------------------------------------------------------

    def save_async(self, step: int, shards: Shards) -> None:
        """Copy `shards` (the caller may change its tensors as soon as this returns), then
        write them as part of `step` on the background thread, each whole (`save_parts`)."""
        self.save_parts(step, [CheckpointPart(key=ShardKey(*key), tensors=tensors) for key, tensors in shards.items()])

    def save_parts(self, step: int, parts: Sequence[CheckpointPart]) -> float:
        """Copy `parts` (whole shards, or heads and slices of shards written sliced: `slices.py`),
        then write them as part of `step` on the background thread. On CUDA the copies go to
        pinned host memory behind the current stream, and the writer thread waits for them: the
        training thread does not block, unless an earlier step still waits to be written (module
        doc): the seconds it waited for that are returned."""
        self._raise_pending()
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        start = time.perf_counter()
        stuck = self._slot.wait_free(self.max_wait_s)  # before the copy: at most two copies held
        waited = time.perf_counter() - start
        if stuck is not None:  # a stalled disk: skip this step rather than stall training for good
            with self._lock:
                self._failed.append(FailedSave(step=step, reason=(
                    f"skipped: step {stuck.step} has waited {waited:.0f} s for the writer, still on an earlier "
                    f"step (a stalled disk in {self.directory}?)")))
            return waited
        start = time.perf_counter()
        copied: list[CheckpointPart] = []
        for part in parts:
            self._check_key(part.key)
            if not part.tensors and part.sliced is None:
                raise ValueError(f"shard {part.key} has no tensors")
            copy = {}
            for name, t in part.tensors.items():
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"shard {part.key} entry {name!r} is a {type(t).__name__}, not a tensor")
                copy[name] = host_copy(t)
            copied.append(replace(part, key=ShardKey(*part.key), tensors=copy))
        devices = {t.device for part in parts for t in part.tensors.values()}
        ready = mark(devices.pop()) if len(devices) == 1 else None
        job = _Job(step=step, parts=copied, copy_s=time.perf_counter() - start, ready=ready, waited_s=waited)
        self._ensure_thread()
        self._slot.put(job)
        return waited

    def flush(self) -> None:
        """Wait until every queued save is on disk; raise CheckpointError if one failed."""
        if self._thread is not None:
            self._slot.drain()
        self._raise_pending()

    def take_failures(self) -> list[FailedSave]:
        """The saves that failed with an OSError since the last call (each returned once), oldest
        first. Such a failure does not stop the writer: the next save is tried as usual."""
        with self._lock:
            failed, self._failed = self._failed, []
        return failed

    def close(self) -> None:
        """Flush, then stop the background thread."""
        try:
            self.flush()
        finally:
            if self._thread is not None:
                self._slot.close()
                self._thread.join()
                self._thread, self._slot = None, _Slot()

    def _check_key(self, key: ShardKey) -> None:
        layer, tp_rank = key
        if not (0 <= layer < self.num_layers and 0 <= tp_rank < self.tp_degree):
            raise ValueError(
                f"shard (layer {layer}, tp {tp_rank}) outside the model's "
                f"{self.num_layers} layers x {self.tp_degree} tensor-parallel ranks"
            )

    def _raise_pending(self) -> None:
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            raise CheckpointError(f"a background checkpoint write in {self.directory} failed: {err}") from err

    def warm(self) -> None:
        """Start the background thread now: it imports torch.distributed.checkpoint before any
        save needs it (see the module docstring)."""
        self._ensure_thread()

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
            self._thread.start()

    # ---- background thread ---------------------------------------------------------------

    def _run(self) -> None:
        import torch.distributed.checkpoint  # noqa: F401  (here, not on the caller's thread)

        while (job := self._slot.take()) is not None:
            try:
                settle(job.ready)
                self._write(job)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread by flush()
                if self._pruned(job.step):
                    continue  # another writer pruned the step: newer complete checkpoints exist
                with self._lock:
                    if not isinstance(e, (KeyboardInterrupt, SystemExit)) and self.directory.is_dir():
                        self._failed.append(FailedSave(step=job.step, reason=self._describe(e)))
                    else:  # no checkpoint directory at all: a configuration error, not a disk fault
                        self._error = e
            finally:
                self._slot.done()

    def _describe(self, exc: BaseException) -> str:
        """One line on a failed write: the OSError behind it when there is one (torch reports a
        full disk as a RuntimeError of its zip writer), and the free space left."""
        disk = _os_error(exc)
        if disk is not None:
            text = f"[Errno {disk.errno}] {disk.strerror}" if disk.errno is not None else str(disk)
            text += f": {disk.filename}" if disk.filename else ""
        else:
            failures = getattr(exc, "failures", None)
            inner = next(iter(failures.values())) if isinstance(failures, dict) and failures else exc
            inner = inner[0] if isinstance(inner, tuple) else inner
            text = f"{type(inner).__name__}: {str(inner).strip().splitlines()[-1] if str(inner).strip() else ''}"
        with contextlib.suppress(OSError):
            text += f" ({shutil.disk_usage(self.directory).free} bytes free in {self.directory})"
        return text

    def _pruned(self, step: int) -> bool:
        """Whether another writer pruned `step` (False when the directory cannot be read: the
        failure is then reported, and the writer thread, which the next save waits on, lives on)."""
        try:
            if step_dir(self.directory, step).exists():
                return False
            done = complete_steps(self.directory, num_layers=self.num_layers, tp_degree=self.tp_degree)
        except OSError:
            return False
        return len(done) >= self.keep and done[-self.keep] > step

    def _write(self, job: _Job) -> None:
        import torch.distributed.checkpoint as dcp  # on first use (see the module docstring)

        start = time.perf_counter()
        nbytes = 0
        for part in job.parts:
            info = part.sliced
            marker = ShardMarker(step=job.step, layer=part.key.layer, tp_rank=part.key.tp_rank, data="",
                                 names=list(part.tensors), num_layers=self.num_layers, tp_degree=self.tp_degree,
                                 **({} if info is None else {**asdict(info), "version": MARKER_VERSION}))
            data = new_data_dir(self.directory, job.step, marker.stem)
            try:
                data.parent.mkdir(parents=True, exist_ok=True)
                dcp.save(part.tensors, storage_writer=dcp.FileSystemWriter(data, sync_files=True), no_dist=True)
                write_marker(self.directory, marker, data)
            except BaseException:
                with contextlib.suppress(OSError):  # no marker points to it: free the space
                    shutil.rmtree(data)
                raise
            _remove_stale_data(data)
            nbytes += sum(t.numel() * t.element_size() for t in part.tensors.values())
        prune(self.directory, num_layers=self.num_layers, tp_degree=self.tp_degree, keep=self.keep)
        record = SaveRecord(
            step=job.step,
            shards=len(job.parts),
            bytes=nbytes,
            copy_s=job.copy_s,
            waited_s=job.waited_s,
            write_s=time.perf_counter() - start,
        )
        with self._lock:
            self.records.append(record)


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind a failed write, if one is: the exception itself, its cause or context,
    or one of the per-rank failures a `torch.distributed.checkpoint` CheckpointException wraps."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for f in failures.values():  # rank -> (exception, traceback)
                todo.append(f[0] if isinstance(f, tuple) else f)
    return None


def _remove_stale_data(current: Path) -> None:
    """Drop data directories of earlier (superseded or killed) writes of the same shard."""
    stem = current.name.rsplit(".", 1)[0]
    for entry in current.parent.iterdir():
        if entry != current and entry.is_dir() and entry.name.startswith(stem + "."):
            with contextlib.suppress(OSError):
                shutil.rmtree(entry)
