"""bench/leader_round.py at a small size, against a real etcd: the leader's mirror of `sync/`
gives the reports that reading and decoding them all gives (the bench refuses to time them
otherwise), with one key a worker or one a node, and every figure it reports is measured."""

from __future__ import annotations

import pytest

from bench.leader_round import one


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("form", ["worker", "node"])
def test_the_mirror_gives_the_reports_a_full_read_gives(form: str) -> None:
    row = one(nodes=6, gpus=3, repeats=1, form=form)
    assert row["workers"] == 18 and row["nodes"] == 6 and row["form"] == form
    assert all(row[k] > 0 for k in ("baseline_s", "mirror_s", "holdings_s", "decode_s", "reports_bytes"))
    assert row["ratio"] == row["mirror_s"] / row["baseline_s"]
