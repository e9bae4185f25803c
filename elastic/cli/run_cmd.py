"""`elastic run` (placeholder until the runner lands)."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("run", help="(not yet implemented)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    print("elastic run: not yet implemented")
    return 2
