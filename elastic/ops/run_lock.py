"""Who uses a run directory: `<run_dir>/launcher.lock`, flock'd by the live `elastic run` using it.

`RunDirLock.acquire(run_dir)` takes an exclusive `fcntl.flock` on the file and writes the
launcher's record into it (pid, start time, whether the job's etcd is its own, in
`<run_dir>/etcd`); a second launcher gets `RunDirInUse` naming that pid. The lock lives as long
as the file description: the kernel drops it when the launcher dies, however it dies, so a
stale file from a SIGKILLed launcher never blocks (its record stays, for `elastic status` and
`elastic events`: elastic/ops/run_history.py). `release()` (a launcher's orderly end) removes
the file. The descriptor is close-on-exec and closed in a forked child, so no child process
keeps the lock of a dead launcher.

Readers (`probe`) test the lock with a shared, non-blocking flock, held for a moment only; a
launcher retries a refused lock for `_ACQUIRE_TRIES` x `_RETRY_S` so that a reader's test never
reads as a rival launcher.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path

from elastic.coordinator.jsonrecord import JsonRecord, RecordError

LOCK_FILE = "launcher.lock"
_ACQUIRE_TRIES = 10
_RETRY_S = 0.02


@dataclass(frozen=True, kw_only=True)
class LauncherRecord(JsonRecord):
    """The launcher that holds (or held) a run directory."""

    pid: int
    """Its process id."""
    started_at: float
    """Wall time (Unix seconds) it took the run directory."""
    embedded_etcd: bool
    """Whether the job's etcd is the launcher's own (data in `<run_dir>/etcd`), not an external one."""


class RunDirInUse(RuntimeError):
    """Another live launcher holds the run directory."""

    def __init__(self, run_dir: Path, pid: int | None) -> None:
        self.pid = pid
        who = f"pid {pid}" if pid is not None else "another process"
        super().__init__(f"run dir {run_dir} is in use by a live elastic run ({who}); wait for it, stop it, "
                         "or pick another --run-dir")


@dataclass(frozen=True, kw_only=True)
class LockState:
    """What a reader finds in a run directory's lock file."""

    record: LauncherRecord | None
    """The launcher's record (None: unreadable, or being written)."""
    held: bool
    """Whether a live process holds the lock."""


def _read_record(path: Path) -> LauncherRecord | None:
    try:
        return LauncherRecord.from_json(path.read_text())
    except (OSError, RecordError):
        return None


class RunDirLock:
    """The lock of one run directory, held by this process (module doc)."""

    def __init__(self, run_dir: Path, fd: int, *, created_dir: bool) -> None:
        self.run_dir = run_dir
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = fd
        self._created_dir = created_dir
        os.register_at_fork(after_in_child=self._close_in_child)

    @classmethod
    def acquire(cls, run_dir: Path, *, embedded_etcd: bool) -> RunDirLock:
        """Take `run_dir` (created if missing) for this process; RunDirInUse if a live launcher has it."""
        created = not run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_FILE
        for attempt in range(_ACQUIRE_TRIES):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if attempt + 1 == _ACQUIRE_TRIES:
                    record = _read_record(path)
                    raise RunDirInUse(run_dir, record.pid if record is not None else None) from None
                time.sleep(_RETRY_S)
                continue
            if _same_file(fd, path):  # not a file a releasing launcher unlinked under us
                record = LauncherRecord(pid=os.getpid(), started_at=time.time(), embedded_etcd=embedded_etcd)
                os.ftruncate(fd, 0)
                os.pwrite(fd, record.to_json().encode(), 0)
                return cls(run_dir, fd, created_dir=created)
            os.close(fd)
        raise RunDirInUse(run_dir, None)

    def release(self) -> None:
        """Remove the lock file and let go (and remove the run directory if this lock created it
        and nothing else was written there: a refused run leaves nothing behind)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            if _same_file(fd, self.path):
                self.path.unlink()
        os.close(fd)
        if self._created_dir:
            with contextlib.suppress(OSError):
                self.run_dir.rmdir()  # only if empty

    def _close_in_child(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # the parent's lock stays: the file description is still open there


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def probe(run_dir: Path) -> LockState | None:
    """The lock of `run_dir` as a reader sees it, or None if it has no lock file (no launcher
    took it through `RunDirLock`, or the last one ended in order and removed it)."""
    path = run_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            held = False
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            held = True
    finally:
        os.close(fd)
    return LockState(record=_read_record(path), held=held)
