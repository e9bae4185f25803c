"""`elastic drain`: placeholder until its module lands (see the operations and benchmark issues)."""

from __future__ import annotations

import argparse
from typing import Any

from elastic.cli.main import UsageError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("drain", help="(not built yet)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    raise UsageError("not built yet")
