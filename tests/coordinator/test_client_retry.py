"""The etcd client rides out an etcd restart: unary calls retry transient errors for `retry_s`."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import etcd3.exceptions
import grpc
import pytest

from elastic.coordinator import EtcdConfig, EtcdServer, connect
from elastic.coordinator.client import _retrying, etcd_unreachable

pytestmark = pytest.mark.timeout(60)


@pytest.mark.slow
def test_calls_during_an_outage_block_then_succeed(tmp_path: Path) -> None:
    with EtcdServer(data_dir=tmp_path / "etcd") as server:
        client = connect(EtcdConfig(endpoint=server.endpoint, retry_s=20.0))
        client.put("/retry/before", "1")
        server.stop(kill=True)
        waited: list[float] = []
        errors: list[BaseException] = []

        def put_while_down() -> None:
            start = time.monotonic()
            try:
                client.put("/retry/during", "2")
            except BaseException as exc:  # reported below
                errors.append(exc)
            waited.append(time.monotonic() - start)

        writer = threading.Thread(target=put_while_down)
        writer.start()
        time.sleep(1.0)
        # Restarted from this (the main) thread: etcd's PR_SET_PDEATHSIG follows the thread
        # that started it, so a short-lived thread must not start it.
        server.start()
        writer.join(30.0)
        try:
            assert not writer.is_alive() and not errors, errors
            assert waited[0] >= 0.9, f"the put returned after {waited[0]:.2f} s, before etcd was back"
            value, _ = client.get("/retry/during")
            assert value == b"2"
            assert client.get("/retry/before")[0] == b"1"
        finally:
            client.close()


def test_no_retry_fails_at_once(tmp_path: Path) -> None:
    with EtcdServer(data_dir=tmp_path / "etcd") as server:
        endpoint = server.endpoint
    client = connect(EtcdConfig(endpoint=endpoint, retry_s=0.0))
    start = time.monotonic()
    with pytest.raises(etcd3.exceptions.ConnectionFailedError):
        client.get("/retry/x")
    assert time.monotonic() - start < 3.0
    client.close()


def test_a_refusal_is_not_retried(etcd_server: EtcdServer) -> None:
    client = connect(EtcdConfig(endpoint=etcd_server.endpoint, retry_s=20.0))
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        client.revoke_lease(0x1234567)  # no such lease: NOT_FOUND is an answer, not an outage
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert time.monotonic() - start < 3.0
    client.close()


def test_retry_s_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="retry_s must be >= 0"):
        EtcdConfig(endpoint="127.0.0.1:2379", retry_s=-1)


class _Answer(grpc.RpcError):
    """A gRPC status as etcd3 passes it on (a pure unit: the classification of one answer)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_a_server_side_timeout_counts_as_etcd_out_of_reach() -> None:
    # What a member without quorum answered a CI run's leader, which then died of it.
    assert etcd_unreachable(_Answer(grpc.StatusCode.UNKNOWN, "context deadline exceeded"))
    assert etcd_unreachable(_Answer(grpc.StatusCode.UNKNOWN, "etcdserver: request timed out"))
    assert etcd_unreachable(etcd3.exceptions.ConnectionTimeoutError())
    # What 16,384 simulated ranks' rendezvous got from one etcd (bench/rendezvous_scale.py).
    assert etcd_unreachable(_Answer(grpc.StatusCode.UNKNOWN, "etcdserver: too many requests"))
    assert etcd_unreachable(_Answer(grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: too many requests"))
    assert not etcd_unreachable(_Answer(grpc.StatusCode.RESOURCE_EXHAUSTED, "grpc: received message larger than max"))
    # Answers, not outages: retrying them cannot help.
    assert not etcd_unreachable(_Answer(grpc.StatusCode.UNKNOWN, "etcdserver: key is not provided"))
    assert not etcd_unreachable(_Answer(grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found"))
    assert not etcd_unreachable(ValueError("context deadline exceeded"))


def test_an_overloaded_etcds_refusal_is_retried_with_random_growing_pauses(etcd_server: EtcdServer) -> None:
    """etcd refused 16,384 ranks' rendezvous writes as "too many requests" (its apply 5,000 entries
    behind its commits): the write was not applied, so the client retries it, past `retry_s`,
    with random pauses that grow (a pure unit of the wrapper, around a real client's put)."""
    client = connect(EtcdConfig(endpoint=etcd_server.endpoint, retry_s=0.05))
    busy = _Answer(grpc.StatusCode.UNKNOWN, "etcdserver: too many requests")
    attempts: list[float] = []

    def put(self: object, key: str, value: str) -> object:
        attempts.append(time.monotonic())
        if len(attempts) <= 4:
            raise busy
        return client.put(key, value)

    _retrying(put)(client, "/busy/k", "v")
    assert len(attempts) == 5 and client.get("/busy/k")[0] == b"v"
    pauses = [b - a for a, b in zip(attempts, attempts[1:], strict=False)]
    assert max(pauses) <= 0.1 * 2**3 + 0.05, pauses  # at most 0.1 s x 2^n: none waited longer

    attempts.clear()
    client.retry_s = 0.0  # a client told not to retry (stop_retrying) fails at once
    with pytest.raises(grpc.RpcError):
        _retrying(put)(client, "/busy/k", "w")
    assert len(attempts) == 1
