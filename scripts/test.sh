#!/usr/bin/env bash
# The README's test command: install (idempotent) into ./.venv, lint, type-check, run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check elastic templates tests bench
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
