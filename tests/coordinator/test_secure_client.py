"""Our etcd client against a TLS + auth etcd (tests/secure_etcd.py): it authenticates again when
etcd forgets its token (the token's TTL ran out while the client was idle), where the stock
python-etcd3 client fails for good; and the environment is its only source of
credentials (`config_from_env`, `credentials_env`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import etcd3
import grpc
import pytest

from elastic.coordinator.client import EtcdConfig, connect
from elastic.coordinator.credentials import EtcdAccessError, config_from_env, credentials_env
from tests.secure_etcd import JOB_PASSWORD, Pki, SecureEtcd, make_pki

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

JOB = "tok"
TTL_S = 1


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def secure(pki: Pki, tmp_path: Path) -> Iterator[SecureEtcd]:
    with SecureEtcd(pki, tmp_path / "etcd", extra_args=("--auth-token-ttl", str(TTL_S))) as etcd:
        etcd.enable_auth(job=JOB)
        yield etcd


def _stock_client(etcd: SecureEtcd) -> etcd3.MultiEndpointEtcd3Client:
    creds = etcd3.MultiEndpointEtcd3Client.get_secure_creds(str(etcd.pki.ca), str(etcd.pki.node_key),
                                                            str(etcd.pki.node_cert))
    endpoint = etcd3.Endpoint("127.0.0.1", etcd.client_port, secure=True, creds=creds)
    return etcd3.MultiEndpointEtcd3Client(endpoints=[endpoint], timeout=5, user=f"{JOB}-user", password=JOB_PASSWORD)


def test_an_expired_token_is_renewed(secure: SecureEtcd) -> None:
    ours, stock = connect(config_from_env(secure.endpoint, secure.job_env())), _stock_client(secure)
    ours.put(f"/elastic/{JOB}/a", "1")
    stock.put(f"/elastic/{JOB}/b", "2")
    time.sleep(TTL_S + 2.5)  # both tokens expire unused (etcd sweeps them about once a second)
    with pytest.raises(grpc.RpcError) as stale:
        stock.get(f"/elastic/{JOB}/b")
    assert stale.value.code() == grpc.StatusCode.UNAUTHENTICATED  # the reference: a token does expire
    assert ours.get(f"/elastic/{JOB}/a")[0] == b"1"
    ours.close()
    stock.close()


def test_credentials_round_trip_through_the_environment(secure: SecureEtcd, tmp_path: Path) -> None:
    env = secure.job_env()
    config = config_from_env(secure.endpoint, env, timeout=2.0)
    assert config == EtcdConfig(endpoint=secure.endpoint, user=f"{JOB}-user", password=JOB_PASSWORD,
                                ca_cert=str(secure.pki.ca), cert_cert=str(secure.pki.node_cert),
                                cert_key=str(secure.pki.node_key), timeout=2.0)
    assert credentials_env(config) == env
    assert config_from_env(secure.endpoint, {}) == EtcdConfig(endpoint=secure.endpoint)
    with pytest.raises(EtcdAccessError, match=r"user and password must be given together"):
        config_from_env(secure.endpoint, secure.job_env(ELASTIC_ETCD_PASSWORD=None))
    with pytest.raises(EtcdAccessError, match=r"\$ELASTIC_ETCD_KEY=.*gone.key: no such file"):
        config_from_env(secure.endpoint, secure.job_env(ELASTIC_ETCD_KEY=str(tmp_path / "gone.key")))
