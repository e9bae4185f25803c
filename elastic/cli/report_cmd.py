"""`elastic report RUN_DIR`: draw a finished run's timeline (report.png) and say what happened."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from elastic.cli.main import UsageError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "report",
        help="draw a finished run's loss/throughput timeline with its failures (report.png)",
        description="Read RUN_DIR/summary.json and write RUN_DIR/report.png: loss and throughput over "
        "wall time, failures marked, recoveries shaded, generation changes marked. Prints the PNG's "
        "path and a one-paragraph summary of the run.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="run directory holding summary.json")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from elastic.ops.report import SUMMARY_FILE, ReportError, summary_text, write_report

    run_dir: Path = args.run_dir
    if not run_dir.is_dir():
        raise UsageError(f"run directory {run_dir} does not exist")
    if not (run_dir / SUMMARY_FILE).is_file():
        raise UsageError(f"{run_dir / SUMMARY_FILE} not found (an `elastic run` writes it when the run ends)")
    try:
        text = summary_text(run_dir)
        path = write_report(run_dir)
    except ReportError as exc:
        print(f"elastic report: error: {exc}", file=sys.stderr)
        return 1
    print(path)
    print(text)
    return 0
