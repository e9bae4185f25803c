"""Warm parents: a process that pays the interpreter and `import torch` once, then forks workers.

`python -m elastic.roles.zygote --socket PATH --parent PID` binds a Unix SOCK_SEQPACKET socket
at PATH (in a private 0700 directory), imports the modules named in $ELASTIC_ZYGOTE_PRELOAD
(comma-separated; not on the command line, where `ps` readers look for the runtime's roles) and
serves spawn requests: each request names a module, its argv, the child's environment and
working directory, and carries three file descriptors (stdin, stdout, stderr). The zygote
forks; the child takes the descriptors as 0, 1 and 2, the request's environment and signal
defaults, and runs `module.main(argv)` as `python -m module` would, exiting with its result
through the normal interpreter exit. The zygote answers the requester with the child's pid at
once, and with its exit code (negative: killed by that signal, as `Popen.returncode`) when it
reaps it, over the same connection.

Why forking is safe here, by construction and checked before every fork:
- No thread is alive in the zygote: it is started with OMP_NUM_THREADS=1 (importing torch with
  more starts an OpenMP worker), never starts a thread, and it counts its own OS threads
  (/proc/self/task) before each fork: more than one refuses the request.
- No CUDA context exists in it: it never touches a device; `torch.cuda.is_initialized()` is
  checked before each fork (a child that needs a device initializes CUDA itself, after fork,
  with the CUDA_VISIBLE_DEVICES of its request).
- Only imports run in it: no etcd client, no gRPC channel, no open process group. A child
  resets the torch thread count from its own OMP_NUM_THREADS.

The zygote dies with its parent (PR_SET_PDEATHSIG): an agent's zygote with the agent, the
local launcher's with the launcher. It runs in a session of its own, so a terminal's Ctrl-C
reaches the launcher, which stops the job, not every process of it at once.

`Zygote` starts one and forks through it; `ZygoteClient` forks through one started elsewhere
(the launcher hands its socket to local agents in $ELASTIC_ZYGOTE); `WarmProcess` is the
`subprocess.Popen` subset the agent and the launcher use. $ELASTIC_WARM=0 turns warm starts off
(every process is a fresh interpreter, as before).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn

ZYGOTE_ENV = "ELASTIC_ZYGOTE"
"""The socket of a warm parent this process's children should be forked from."""
PRELOAD_ENV = "ELASTIC_ZYGOTE_PRELOAD"
"""The modules a zygote imports before it serves (module doc)."""
WARM_ENV = "ELASTIC_WARM"
"""`0` turns warm starts off."""
SPAWNED_AT_ENV = "ELASTIC_SPAWNED_AT"
"""Wall time at which the parent decided to start this process (phases of a start, `StartPhases`)."""
FORKED_AT_ENV = "ELASTIC_FORKED_AT"
"""Wall time at which this process was forked from a warm parent (unset for a cold start)."""
WORKER_PRELOAD = ("elastic.roles.elastic_worker", "elastic.roles.agent", "elastic.roles.worker", "torch.distributed.checkpoint")
"""What a zygote imports for the runtime's processes (torch comes with the worker)."""
TITLE_ROOM = 2048
"""Bytes of room in a zygote's command line for its children's (`_retitle`)."""
_MAX_MESSAGE = 1 << 20
_CONNECT_S = 30.0


class ZygoteError(RuntimeError):
    """The warm parent refused a request or is gone."""


def warm_enabled() -> bool:
    """Whether processes should come from a warm parent ($ELASTIC_WARM, default on)."""
    return os.environ.get(WARM_ENV, "1") != "0"


# ---- the zygote process ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Request:
    module: str
    argv: list[str]
    env: dict[str, str]
    cwd: str | None


def _fork_safe() -> str | None:
    """Why forking now would be unsafe (None: safe)."""
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads != 1:
        return f"the warm parent has {threads} threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the warm parent holds a CUDA context"
    return None


def _read_request(conn: socket.socket) -> tuple[_Request, list[int]] | None:
    msg, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 3)
    if not msg:
        for fd in fds:
            os.close(fd)
        return None
    data = json.loads(msg)
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a spawn request carries 3 descriptors, got {len(fds)}")
    return _Request(module=data["module"], argv=list(data["argv"]), env=dict(data["env"]), cwd=data.get("cwd")), fds


def _serve(listener: socket.socket) -> _Request:
    """Serve spawn requests until this process is a forked child; returns the child's request."""
    sel = selectors.DefaultSelector()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes select through the wakeup fd
    signal.set_wakeup_fd(wake_w)
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    waiting: dict[int, socket.socket] = {}  # pid -> its requester's connection
    requests: set[socket.socket] = set()
    while True:
        for key, _ in sel.select(timeout=1.0):
            if key.data == "accept":
                conn, _ = listener.accept()
                requests.add(conn)
                sel.register(conn, selectors.EVENT_READ, "request")
            elif key.data == "request":
                conn = key.fileobj  # type: ignore[assignment]
                sel.unregister(conn)
                requests.discard(conn)
                try:
                    got = _read_request(conn)
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    _answer(conn, {"error": f"bad spawn request: {exc}"})
                    conn.close()
                    continue
                if got is None:
                    conn.close()
                    continue
                request, fds = got
                unsafe = _fork_safe()
                if unsafe is not None:
                    for fd in fds:
                        os.close(fd)
                    _answer(conn, {"error": f"refused to fork: {unsafe}"})
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    sel.close()
                    for sock in (listener, conn, *requests, *waiting.values()):
                        sock.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    _become(request, fds)
                    return request
                for fd in fds:
                    os.close(fd)
                if _answer(conn, {"pid": pid}):
                    waiting[pid] = conn
                else:
                    conn.close()
            else:
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake_r, 512):
                        pass
        _reap(waiting)


def _answer(conn: socket.socket, message: dict[str, Any]) -> bool:
    try:
        conn.send(json.dumps(message).encode())
        return True
    except OSError:  # the requester is gone; its child runs on (it dies with its own parent)
        return False


def _reap(waiting: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            _answer(conn, {"exit": os.waitstatus_to_exitcode(status)})
            conn.close()


def _become(request: _Request, fds: list[int]) -> None:
    """In the forked child: take the request's descriptors, environment and signal defaults."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own standard streams
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(request.env)
    os.environ[FORKED_AT_ENV] = repr(time.time())
    if request.cwd is not None:
        os.chdir(request.cwd)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch = sys.modules.get("torch")
    threads = request.env.get("OMP_NUM_THREADS")
    if torch is not None and threads and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    sys.argv = [request.module, *request.argv]
    _retitle([sys.executable, "-m", request.module, *request.argv])


def _retitle(args: list[str]) -> None:
    """Make /proc/PID/cmdline (what `ps` and psutil show) read `python -m module argv...`, as a
    fresh interpreter's would: rewrite the argument area in place. The zygote's own command line
    ends with `TITLE_ROOM` spaces of room for it; a title that does not fit is left out."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start and arg_end (proc(5): fields 48, 49)
        data = b"\0".join(a.encode() for a in args) + b"\0"
        if len(data) > end - start:
            return
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(data + b"\0" * (end - start - len(data)))
    except (OSError, ValueError, IndexError):
        pass  # the title is for people; the process works without it


def _set_parent_death() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elastic.roles.zygote", description=__doc__)
    parser.add_argument("--socket", required=True, help="path of the Unix socket to serve")
    parser.add_argument("--parent", type=int, required=True, help="pid of the parent this zygote dies with")
    parser.add_argument("room", nargs="?", default="", help="blank room for the children's command lines")
    args = parser.parse_args(argv)
    _set_parent_death()
    if os.getppid() != args.parent:
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when its processes stop
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(args.socket)  # bound before the imports: requests queue while they run
    listener.listen(128)
    for name in filter(None, os.environ.pop(PRELOAD_ENV, "").split(",")):
        importlib.import_module(name)
    print("ready", flush=True)
    request = _serve(listener)
    module = importlib.import_module(request.module)
    code = module.main(request.argv)
    # Leave as the runtime's processes do (elastic_worker.main): without the interpreter's
    # teardown of every module the zygote loaded (torch's takes a second or more here); output
    # flushed, logging closed.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code if isinstance(code, int) else 0)


# ---- the requester's side ----------------------------------------------------------------


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


if __name__ == "__main__":
    sys.exit(main())
