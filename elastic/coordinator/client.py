"""How to reach etcd: endpoint, credentials, TLS; and a client that survives an etcd restart.

`EtcdConfig` is what a launcher, a worker or the torchrun handler carries around; `connect()`
turns it into a `python3-etcd3` client. The stock client marks an endpoint "failed" for 300 s
after one UNAVAILABLE error, which would make every call fail long after a restarted etcd is
back; ours retries the endpoint at once, so callers only need to retry their own operation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import etcd3
import etcd3.exceptions
import grpc

#: Errors that mean "etcd is unreachable right now", as opposed to a refused operation.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    etcd3.exceptions.ConnectionFailedError,
    etcd3.exceptions.ConnectionTimeoutError,
    etcd3.exceptions.InternalServerError,
    etcd3.exceptions.NoServerAvailableError,
    grpc.RpcError,
)


# Reconnect quickly after an etcd restart (gRPC's default backoff grows to minutes).
# etcd3.Endpoint hands this straight to grpc, which wants a sequence of pairs.
_GRPC_OPTIONS: Any = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


@dataclass(frozen=True, kw_only=True)
class EtcdConfig:
    """Connection settings for the job's etcd."""

    endpoint: str
    """`host:port` of etcd's client URL."""
    user: str | None = None
    """etcd user name when etcd has authentication enabled (needs `password`)."""
    password: str | None = None
    """Password of `user`."""
    ca_cert: str | None = None
    """Path of the CA bundle; setting it switches the connection to TLS."""
    cert_key: str | None = None
    """Path of the client key for mutual TLS (with `cert_cert`)."""
    cert_cert: str | None = None
    """Path of the client certificate for mutual TLS (with `cert_key`)."""
    timeout: float = 5.0
    """Deadline of each unary etcd call, in seconds."""

    def __post_init__(self) -> None:
        host, sep, port = self.endpoint.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"etcd endpoint must look like host:port, got {self.endpoint!r}")
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd user and password must be given together")
        if (self.cert_key is None) != (self.cert_cert is None):
            raise ValueError("cert_key and cert_cert must be given together")
        if self.cert_key is not None and self.ca_cert is None:
            raise ValueError("mutual TLS (cert_key/cert_cert) needs ca_cert too")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")

    @property
    def host(self) -> str:
        return self.endpoint.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.endpoint.rpartition(":")[2])


def connect(config: EtcdConfig) -> etcd3.MultiEndpointEtcd3Client:
    """A client for `config` whose endpoint is retried immediately after a failure."""
    secure = config.ca_cert is not None
    creds = None
    if secure:
        creds = etcd3.MultiEndpointEtcd3Client.get_secure_creds(
            config.ca_cert, config.cert_key, config.cert_cert
        )
    endpoint = etcd3.Endpoint(
        config.host, config.port, secure=secure, creds=creds, time_retry=0.0, opts=_GRPC_OPTIONS
    )
    return etcd3.MultiEndpointEtcd3Client(
        endpoints=[endpoint], timeout=config.timeout, user=config.user, password=config.password
    )
