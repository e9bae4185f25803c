"""A module the zygote tests fork: prints what its process got, then exits as told."""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str]) -> int:
    torch = sys.modules.get("torch")
    print(json.dumps({
        "argv": argv, "pid": os.getpid(), "cwd": os.getcwd(), "env": os.environ.get("ZCHILD"),
        "threads": torch.get_num_threads() if torch is not None else None,
        "stdin": sys.stdin.read(),
    }), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if argv[0] == "sleep":
        time.sleep(float(argv[1]))
    if argv[0] == "raise":
        raise SystemExit(int(argv[1]))
    return int(argv[-1])
