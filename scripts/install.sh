#!/usr/bin/env bash
# Idempotent install into ./.venv: torch first (pinned, CPU build), then the package with
# its dev tools, constrained so nothing replaces torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    .venv/bin/pip install -q -c scripts/constraints.txt torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
fi
stamp=.venv/.elastic-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/pip install -q -c scripts/constraints.txt -e '.[dev]' 2>&1 | grep -v "^WARNING: Location" || true
fi
# pip's output is filtered above (this machine's mirror config warns per package), so check
# the result explicitly rather than trusting pipe status.
if ! .venv/bin/python -c "import torch, etcd3, grpc, google.protobuf, psutil, pytest, prometheus_client, matplotlib, yaml, elastic, templates" \
        || [ ! -x .venv/bin/elastic ]; then
    rm -f "$stamp"
    echo "install.sh: installation is incomplete (see pip's messages above)" >&2
    exit 1
fi
touch "$stamp"
