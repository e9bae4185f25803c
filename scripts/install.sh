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
# The project's bytecode, written now: where Python is told not to write it
# (PYTHONDONTWRITEBYTECODE, as on the machines this was measured on), every process would
# otherwise compile what it imports from source at each start (0.1-0.2 s of a core for each
# `elastic` command and launcher; a second here, and nothing when it is up to date).
.venv/bin/python -m compileall -q -j 0 elastic templates >/dev/null
