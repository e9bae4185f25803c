"""A single-member etcd listening on the bridge address, so every node namespace reaches it.

(elastic.coordinator.EtcdServer binds 127.0.0.1, which a namespace cannot reach: its loopback
is its own.) The bridge is a private link of this machine; nothing outside it is exposed.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from elastic.coordinator.etcd_server import find_etcd_binary


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class BridgeEtcd:
    """etcd on `host` (the bridge address) with its data and log under `data_dir`."""

    def __init__(self, *, host: str, data_dir: Path, startup_timeout_s: float = 20.0) -> None:
        self.host = host
        self.data_dir = data_dir
        self.startup_timeout_s = startup_timeout_s
        self.client_port = _free_port(host)
        self.peer_port = _free_port(host)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def start(self) -> BridgeEtcd:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        client_url = f"http://{self.endpoint}"
        peer_url = f"http://{self.host}:{self.peer_port}"
        args = [
            find_etcd_binary(),
            "--name", "elastic",
            "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"elastic={peer_url}",
            "--log-level", "warn",
        ]  # fmt: skip
        with open(self.data_dir / "etcd.log", "ab") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"etcd exited with {self.proc.returncode}; see {self.data_dir / 'etcd.log'}"
                )
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{client_url}/health", timeout=1.0) as resp,
            ):
                if b'"health":"true"' in resp.read():
                    return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"etcd on {self.endpoint} not healthy after {self.startup_timeout_s} s")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s, by PID."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
