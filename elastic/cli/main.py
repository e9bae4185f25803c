"""The `elastic` command: one subcommand per module in this package.

Each subcommand module exposes `register(subparsers)`, which adds its parser and sets
`func` (a callable taking the parsed namespace and returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Subcommand modules, in the order `elastic --help` lists them.
SUBCOMMANDS: tuple[str, ...] = (
    "run", "plan", "profile", "status", "events", "inject", "drain", "stragglers", "report", "simulate",
    "export", "sample",
    "prepare_data",  # elastic prepare-data (elastic/cli/prepare_data_cmd.py)
)


class UsageError(ValueError):
    """A bad command-line value: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic",
        description="Fault-tolerant elastic training: plan, run and operate heterogeneous pipeline jobs.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"elastic.cli.{name}_cmd")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: `elastic run` prints its --resume command
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"elastic {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"elastic {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # `python -m elastic.cli.main`: run the imported module's `main`, whose UsageError is the one
    # the subcommands raise (this file, run as __main__, defines a class of the same name).
    from elastic.cli.main import main as _main

    sys.exit(_main())
