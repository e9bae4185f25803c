"""`elastic plan` (placeholder until the planner lands)."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("plan", help="(not yet implemented)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    print("elastic plan: not yet implemented")
    return 2
