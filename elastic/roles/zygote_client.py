"""The requester's side of a warm parent (elastic/roles/zygote.py, the zygote's side): start
one, fork processes through it, and follow them.

`Zygote` starts one and forks through it; `ZygoteClient` forks through one started elsewhere
(the launcher hands its socket to local agents in $ELASTIC_ZYGOTE); `WarmProcess` is the
`subprocess.Popen` subset the agent and the launcher use. `warm_parent` picks the one a process
should use ($ELASTIC_WARM=0: none), `start_process` forks from it or starts a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, NoReturn

from elastic.roles.zygote import (
    PRELOAD_ENV,
    SPAWNED_AT_ENV,
    TITLE_ROOM,
    WORKER_PRELOAD,
    ZYGOTE_ENV,
    ZygoteError,
    warm_enabled,
)

_CONNECT_S = 30.0


class WarmProcess:
    """A process forked by a zygote: the `subprocess.Popen` subset the runtime uses."""

    def __init__(self, pid: int, conn: socket.socket, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._conn = conn
        # The zygote reaps the child, not us: a pidfd keeps a signal from reaching another process
        # that reuses the pid before the zygote's report of the exit is read.
        self._pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                self._take(self._conn.recv(4096))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(None if timeout is None else max(timeout, 1e-6))
            try:
                self._take(self._conn.recv(4096))
            except (TimeoutError, BlockingIOError):
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0) from None
        assert self.returncode is not None
        return self.returncode

    def _take(self, msg: bytes) -> None:
        if not msg:  # the zygote is gone before reporting: the child died with it (or will)
            self.returncode = -signal.SIGKILL
        else:
            self.returncode = int(json.loads(msg)["exit"])
        self._conn.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if self._pidfd is not None:
                    signal.pidfd_send_signal(self._pidfd, sig)
                else:
                    os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class ZygoteClient:
    """Forks processes through the zygote serving `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def close(self) -> None:
        """Nothing to stop: the zygote is someone else's (`Zygote.close` stops one of our own)."""

    def spawn(self, module: str, argv: list[str], *, env: dict[str, str], stdout: IO[Any] | int,
              stderr: IO[Any] | int | None = None, cwd: str | None = None) -> WarmProcess:
        """Fork `python -m module argv...` from the warm parent; ZygoteError if it cannot."""
        env = {**env, SPAWNED_AT_ENV: env.get(SPAWNED_AT_ENV, repr(time.time()))}
        conn = self._connect()
        out = stdout if isinstance(stdout, int) else stdout.fileno()
        err = out if stderr is None or stderr == subprocess.STDOUT else (
            stderr if isinstance(stderr, int) else stderr.fileno())
        with open(os.devnull, "rb") as devnull:
            message = json.dumps({"module": module, "argv": argv, "env": env, "cwd": cwd}).encode()
            try:
                socket.send_fds(conn, [message], [devnull.fileno(), out, err])
                answer = conn.recv(4096)
            except OSError as exc:
                conn.close()
                self._gone(f"did not answer ({exc})")
        if not answer:
            conn.close()
            self._gone("closed the connection")
        reply = json.loads(answer)
        if "pid" not in reply:
            conn.close()
            raise ZygoteError(f"the warm parent refused: {reply.get('error')}")
        return WarmProcess(int(reply["pid"]), conn, [module, *argv])

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + _CONNECT_S
        while True:
            self._check_alive()
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                conn.connect(self.path)
                return conn
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                conn.close()
                if time.monotonic() > deadline:
                    raise ZygoteError(f"no warm parent at {self.path}: {exc}") from None
                time.sleep(0.01)

    def _check_alive(self, *, wait_s: float = 0.0) -> None:
        """ZygoteError if the warm parent is known to be gone (a client cannot know), waiting up
        to `wait_s` for a parent that is going."""

    def _gone(self, what: str) -> NoReturn:
        """A request broke off: ZygoteError, saying that the parent exited when it did."""
        self._check_alive(wait_s=1.0)
        raise ZygoteError(f"the warm parent at {self.path} {what} (see its log)")


DIR_PREFIX = "elastic-zyg-"
OWNER_FILE = "owner"
"""In a zygote's directory: the pid of the process that started it (and removes it on close)."""


def sweep_stale(root: str) -> list[str]:
    """Remove this user's zygote directories under `root` whose owner is gone: an owner that was
    SIGKILLed (a failure test's agent, a killed launcher) cannot remove its own, and its zygote
    dies with it. The directories removed."""
    removed = []
    for path in Path(root).glob(f"{DIR_PREFIX}*"):
        with contextlib.suppress(OSError, ValueError):
            if path.stat().st_uid != os.getuid():
                continue
            pid = int((path / OWNER_FILE).read_text())
            try:
                os.kill(pid, 0)
                continue  # alive (a reused pid keeps a stale directory: the safe side)
            except ProcessLookupError:
                pass
            shutil.rmtree(path)
            removed.append(str(path))
    return removed


class Zygote(ZygoteClient):
    """A zygote started by this process (from the calling thread: it dies when that thread's
    process ends); `close` stops it. Its imports run while the caller goes on. Its directory
    names its owner (`OWNER_FILE`), so that a later zygote removes it if the owner was killed."""

    def __init__(self, *, preload: tuple[str, ...] = WORKER_PRELOAD, log: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        sweep_stale(tempfile.gettempdir())
        self._dir = tempfile.mkdtemp(prefix=DIR_PREFIX)  # 0700: only this user may ask for forks
        Path(self._dir, OWNER_FILE).write_text(str(os.getpid()))
        super().__init__(os.path.join(self._dir, "s"))
        child_env = dict(os.environ if env is None else env)
        child_env["OMP_NUM_THREADS"] = "1"  # no OpenMP worker thread in the parent (module doc)
        child_env.pop(ZYGOTE_ENV, None)
        child_env[PRELOAD_ENV] = ",".join(preload)
        self._log = open(log, "ab") if log is not None else None  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "elastic.roles.zygote", "--socket", self.path, "--parent", str(os.getpid()), " " * TITLE_ROOM],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log, env=child_env,
            start_new_session=True,
        )

    def _check_alive(self, *, wait_s: float = 0.0) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(wait_s)
        if self.proc.poll() is not None:
            raise ZygoteError(f"the warm parent exited with code {self.proc.returncode} (see its log)")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self._log is not None:
            self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def warm_parent(*, log: Path | None = None) -> ZygoteClient | None:
    """The warm parent this process should fork from: None when warm starts are off
    ($ELASTIC_WARM=0), a client of the one given in $ELASTIC_ZYGOTE (shared, e.g. the local
    launcher's or a test session's), else one of its own (logging to `log`, else to our stderr)
    whose imports run while the caller goes on. `close()` it when done."""
    if not warm_enabled():
        return None
    shared = os.environ.get(ZYGOTE_ENV)
    return ZygoteClient(shared) if shared else Zygote(log=log)


def start_process(module: str, args: list[str], *, zygote: ZygoteClient | None, env: dict[str, str],
                  stdout: IO[Any] | None, stderr: IO[Any] | int, warn: Callable[[str], None]
                  ) -> subprocess.Popen[bytes] | WarmProcess:
    """`python -m module args...`, forked from `zygote`; a fresh interpreter when there is none or
    it fails (said through `warn`). `stdout` None: this process's own; `stderr` may be
    `subprocess.STDOUT`."""
    if zygote is not None:
        try:
            return zygote.spawn(module, args, env=env, stdout=sys.stdout.fileno() if stdout is None else stdout,
                                stderr=stderr)
        except ZygoteError as exc:
            warn(f"{exc}; starting {module} cold")
    return subprocess.Popen([sys.executable, "-m", module, *args], stdout=stdout, stderr=stderr, env=env)
