"""The start of a process, as the `started` events' phases count it (elastic/roles/start_phases.py):
between the parent's start of it and the child's first statement, for a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

_CHILD = """
import time
first = time.time()
from elastic.roles.start_phases import process_start_time
print(first, process_start_time())
"""

_TICK_S = 0.011
"""The kernel counts a start in clock ticks (10 ms), rounded down."""


@pytest.mark.timeout(60)
def test_a_process_starts_after_its_parent_started_it_and_before_its_first_statement() -> None:
    for _ in range(3):
        before = time.time()
        out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True,
                             timeout=50).stdout
        first, started = (float(x) for x in out.split())
        # psutil's create_time() read 0.32 s before `before` on the machine this was written on
        assert before - _TICK_S <= started <= first, (before, started, first)
