"""Mutual TLS on the gRPC shard path: real servers on 127.0.0.1 with certificates made by the
openssl CLI (tests/secure_etcd.py); what a TLS fetch returns is bit-equal to what a plain one
does, and every client the job's CA did not sign, or that does not check the server, is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic.transfer.client import FetchConfig, TransferError, fetch_shards
from elastic.transfer.tls import TlsConfig
from tests.secure_etcd import Pki, make_pki
from tests.transfer.conftest import TOKEN, ServeFn, shard_set
from tests.transfer.shard_data import shards_equal

pytestmark = pytest.mark.timeout(60)

KEYS = [(layer, tp) for layer in range(2) for tp in range(2)]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tls(pki: Pki, **changes: object) -> TlsConfig:
    settings: dict[str, object] = {"ca": str(pki.ca), "cert": str(pki.node_cert), "key": str(pki.node_key), **changes}
    return TlsConfig(**settings)  # type: ignore[arg-type]


def _fetch(address: str, shards: dict, tls: TlsConfig | None) -> dict:  # type: ignore[type-arg]
    config = FetchConfig(token=TOKEN, generation=0, tls=tls, max_attempts=1, stall_timeout_s=5.0)
    return fetch_shards(shards, {address: shards}, config).shards


def test_tls_fetch_is_bit_equal_to_the_plain_one(serve: ServeFn, pki: Pki) -> None:
    shards = shard_set(KEYS)
    plain = serve(shards)
    secure = serve(shards, tls=_tls(pki))
    assert secure.address.startswith("127.0.0.1:")  # binds as a plain server does
    over_tls, in_clear = _fetch(secure.address, shards, _tls(pki)), _fetch(plain.address, shards, None)
    assert over_tls.keys() == in_clear.keys() == shards.keys()
    for key in shards:
        assert shards_equal(over_tls[key], in_clear[key]) and shards_equal(over_tls[key], shards[key]), key


@pytest.mark.parametrize("client", ["plain", "untrusted client cert", "trusts another CA", "wrong server name"])
def test_a_tls_server_refuses_what_the_job_ca_does_not_vouch_for(serve: ServeFn, pki: Pki, client: str) -> None:
    shards = shard_set(KEYS[:1])
    secure = serve(shards, tls=_tls(pki))
    tls = {
        "plain": None,
        "untrusted client cert": _tls(pki, cert=str(pki.other_cert), key=str(pki.other_key)),
        "trusts another CA": _tls(pki, ca=str(pki.other_ca)),
        "wrong server name": _tls(pki, server_name="not-the-node.example"),
    }[client]
    with pytest.raises(TransferError):
        _fetch(secure.address, shards, tls)
    # ... while the right credentials (and a server name the certificate carries) still fetch.
    assert shards_equal(_fetch(secure.address, shards, _tls(pki, server_name="localhost"))[KEYS[0]], shards[KEYS[0]])


def test_a_plain_server_is_not_reached_over_tls(serve: ServeFn, pki: Pki) -> None:
    shards = shard_set(KEYS[:1])
    plain = serve(shards)
    with pytest.raises(TransferError):
        _fetch(plain.address, shards, _tls(pki))


def test_settings_from_the_environment(pki: Pki, tmp_path: Path) -> None:
    own = {"ELASTIC_TLS_CA": str(pki.ca), "ELASTIC_TLS_CERT": str(pki.node_cert), "ELASTIC_TLS_KEY": str(pki.node_key)}
    etcd = {"ELASTIC_ETCD_CA": str(pki.other_ca), "ELASTIC_ETCD_CERT": str(pki.other_cert),
            "ELASTIC_ETCD_KEY": str(pki.other_key)}
    assert TlsConfig.from_env({}) is None
    assert TlsConfig.from_env({"ELASTIC_ETCD_CA": str(pki.ca)}) is None  # etcd TLS without a client cert: plain
    assert TlsConfig.from_env({**own, **etcd}) == _tls(pki)  # ELASTIC_TLS_* win over the etcd credentials
    assert TlsConfig.from_env(etcd) == TlsConfig(ca=str(pki.other_ca), cert=str(pki.other_cert), key=str(pki.other_key))
    assert TlsConfig.from_env({**own, "ELASTIC_TLS_SERVER_NAME": "shard.local"}) == _tls(pki, server_name="shard.local")
    with pytest.raises(ValueError, match=r"missing \$ELASTIC_TLS_KEY"):
        TlsConfig.from_env({**own, "ELASTIC_TLS_KEY": ""})
    with pytest.raises(ValueError, match="no such file"):
        TlsConfig.from_env({**own, "ELASTIC_TLS_CERT": str(tmp_path / "gone.crt")})
