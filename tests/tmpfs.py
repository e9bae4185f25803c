"""A small tmpfs for storage-fault tests (root only): a full disk without filling a real one."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(mountpoint: Path, *, size: str) -> Iterator[Path]:
    """Mount a tmpfs of `size` (e.g. "4m") on `mountpoint` (created), yield it, unmount it.
    Skips the test when not root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mountpoint.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mountpoint)], check=True)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)
