"""Helpers of the coordinator suite: waiting, reading member records, running member processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.polling import wait_for

HERE = Path(__file__).parent
MEMBER = str(HERE / "member_proc.py")
REPO = HERE.parent.parent


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]




class Members:
    """Starts member processes; the fixture kills every one (and their workers) by PID."""

    def __init__(self, endpoint: str, job: str, tmp: Path) -> None:
        self.endpoint, self.job, self.tmp = endpoint, job, tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, node_id: str, role: str = "observer", *, ttl: int = 2) -> Path:
        out = self.tmp / f"{node_id}.jsonl"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.procs[node_id] = subprocess.Popen(
            [sys.executable, MEMBER, self.endpoint, self.job, node_id, str(out), str(ttl), role, "120"],
            env=env,
        )
        return out

    def wait_ready(self, *node_ids: str, timeout: float = 30.0) -> None:
        for n in node_ids:
            wait_for(lambda n=n: any(r["event"] == "ready" for r in self.records(n)), timeout, f"{n} ready")

    def records(self, node_id: str) -> list[dict[str, Any]]:
        return read_records(self.tmp / f"{node_id}.jsonl")

    def kill_all(self) -> None:
        for node_id, proc in self.procs.items():
            for rec in self.records(node_id):
                if rec["event"] == "worker":
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(rec["pid"], signal.SIGKILL)
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait()
