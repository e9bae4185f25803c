"""The agent's liveness probe (elastic/coordinator/probe.py): a real gRPC server and client."""

from __future__ import annotations

import time

import pytest

from elastic.coordinator.probe import ProbeServer, probe

pytestmark = pytest.mark.timeout(30)


def test_a_live_agent_answers_and_a_refusing_one_does_not() -> None:
    state: dict[str, object] | None = {"node_id": "node2", "incarnation": 1, "alive": True}
    server = ProbeServer(lambda: state).start()
    try:
        answer = probe(server.address, deadline_s=2.0)
        assert answer is not None and (answer.node_id, answer.incarnation, answer.alive) == ("node2", 1, True)
        state = None  # an emulated partition: the probe is refused
        assert probe(server.address, deadline_s=2.0) is None
    finally:
        server.stop()
    start = time.monotonic()
    assert probe(server.address, deadline_s=0.5) is None  # nobody listens: refused at once
    assert time.monotonic() - start < 1.0
    assert probe("127.0.0.1:0") is None  # an agent that serves no probe
