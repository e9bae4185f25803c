"""A holder in another process dies (SIGKILL) or hangs (SIGSTOP) mid-stream: the client
completes the fetch from the other holder, bit-exact."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from elastic.transfer.client import FetchConfig, fetch_shards
from elastic.transfer.shards import ShardKey
from tests.transfer.conftest import TOKEN, ServeFn, shard_set
from tests.transfer.shard_data import shards_equal

REPO = Path(__file__).resolve().parents[2]
KEYS = [(layer, 0) for layer in range(4)]


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "hang"])
def test_client_completes_from_another_holder(serve: ServeFn, sig: signal.Signals) -> None:
    shards = shard_set(KEYS, numel=1 << 16)  # the holder process builds the same bytes
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.transfer.holder_proc", TOKEN, "0", str(32 << 10), "3"]
        + [f"{layer}:{tp}" for layer, tp in KEYS],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    signalled = threading.Event()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("PORT "), f"holder process said {line!r}"
        remote = f"127.0.0.1:{int(line.split()[1])}"

        def signal_when_paused() -> None:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() == "PAUSED":
                os.kill(proc.pid, sig)
                signalled.set()

        watcher = threading.Thread(target=signal_when_paused, daemon=True)
        watcher.start()
        local = serve(shards)
        config = FetchConfig(token=TOKEN, generation=0, stall_timeout_s=2.0)
        result = fetch_shards(KEYS, {remote: KEYS, local.address: KEYS}, config)
        assert signalled.is_set()
        for key in KEYS:
            assert shards_equal(result.shards[ShardKey(*key)], shards[ShardKey(*key)]), key
        # The holder stalls while producing its 3rd chunk: at most 2 chunks can have arrived
        # (exactly 2 when it is stopped; a killed one may lose what sat in its send buffer).
        received = result.bytes_by_holder.get(remote, 0)
        assert received == 2 * (32 << 10) if sig == signal.SIGSTOP else received <= 2 * (32 << 10)
        remote_shards = [k for k, reasons in result.incidents.items() if reasons[0].startswith(remote)]
        assert len(remote_shards) == 2 and result.refetches == 2  # its two shards came from `local`
        expected = "UNAVAILABLE" if sig == signal.SIGKILL else "no data for 2.0 s"
        assert all(expected in result.incidents[k][0] for k in remote_shards), result.incidents
        if sig == signal.SIGKILL:
            assert proc.wait(10) == -signal.SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
