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

This file is the zygote's side; the requester's (`Zygote`, `ZygoteClient`, `WarmProcess`,
`start_process`) is elastic/roles/zygote_client.py. $ELASTIC_WARM=0 turns warm starts off
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
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

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
WORKER_PRELOAD = ("elastic.roles.elastic_worker", "elastic.roles.agent", "elastic.roles.static_worker", "torch.distributed.checkpoint",
                  "elastic.roles.leader", "elastic.ops.metrics", "elastic.engine.checkpoint.writers",
                  "elastic.engine.checkpoint.policy", "grpc._server")
"""What a zygote imports for the runtime's processes (torch comes with the worker), with what
they import only once running: the agent's leader and metrics endpoint (prometheus_client,
http.server), the workers' checkpoint writers and policy, gRPC's server. Imported after the fork, they
cost every agent 0.2-0.3 s of a core at its start (tests/roles/test_zygote.py lists them)."""
TITLE_ROOM = 2048
"""Bytes of room in a zygote's command line for its children's (`_retitle`)."""
_MAX_MESSAGE = 1 << 20


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


if __name__ == "__main__":
    sys.exit(main())
