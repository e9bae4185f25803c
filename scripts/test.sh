#!/usr/bin/env bash
# The README's test command: install (idempotent) into ./.venv, lint, type-check, run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, etcd3, grpc" # fail fast if the install is incomplete
.venv/bin/ruff check elastic templates tests bench
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
