"""The committed gRPC stubs are exactly what the .proto generates today."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic.transfer import codegen

pytestmark = pytest.mark.timeout(60)


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (a dev dependency) regenerates the stubs")
    for fresh in codegen.generate(tmp_path):
        committed = codegen.PACKAGE_DIR / fresh.name
        assert committed.read_text() == fresh.read_text(), (
            f"{committed} is stale: run `.venv/bin/python -m elastic.transfer.codegen` and commit"
        )
