"""die_with_parent: a child dies with its SIGKILLed parent, and refuses to start orphaned."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import psutil
import pytest

from tests.polling import wait_for

pytestmark = pytest.mark.timeout(60)

CHILD = """
import os, sys, time
from elastic.coordinator.monitor import die_with_parent
die_with_parent(int(sys.argv[1]))
print("ready", flush=True)
time.sleep(120)
"""

PARENT = """
import subprocess, sys, time, os
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


def test_child_dies_with_its_sigkilled_parent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True)
    child_pid = 0
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert _alive(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        wait_for(lambda: not _alive(child_pid), 5.0, "the orphaned child to die")
    finally:
        parent.kill()
        parent.wait()
        if child_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child_pid, signal.SIGKILL)


def test_child_whose_parent_is_already_gone_exits() -> None:
    # A PID that is not our parent: the parent is taken for dead, the child exits at once.
    proc = subprocess.run([sys.executable, "-c", CHILD, str(os.getpid() + 10**6)], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == -signal.SIGKILL and "ready" not in proc.stdout


def test_child_dies_with_its_agent_when_the_agent_is_not_its_parent() -> None:
    # A warm parent forks the workers of an agent (elastic/roles/zygote.py): the kernel's parent
    # death signal is the zygote's, so the worker waits on a pidfd of its agent instead.
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(agent.pid)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert child.poll() is None
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        assert child.wait(timeout=5) == -signal.SIGKILL
    finally:
        for proc in (agent, child):
            proc.kill()
            proc.wait()
