"""Mutual TLS for the ShardTransfer service: which CA, certificate and key, and the gRPC
credentials made from them.

A shard carries a job's parameters and optimizer state, and every call carries the job token:
on a shared network both should be encrypted, and a server should serve only peers whose
certificate the job's CA signed. `TlsConfig.from_env()` reads the setting every worker of a job
inherits from its agent:

- `ELASTIC_TLS_CA`, `ELASTIC_TLS_CERT`, `ELASTIC_TLS_KEY`: the CA bundle, and this node's
  certificate and key (each one is both the server's and the client's: one certificate with the
  serverAuth and clientAuth key usages, whose SAN names the address the node's server binds,
  `ELASTIC_HOST`, or the name in `ELASTIC_TLS_SERVER_NAME`);
- none of them set: the etcd client credentials `ELASTIC_ETCD_CA`, `ELASTIC_ETCD_CERT`,
  `ELASTIC_ETCD_KEY` when all three are set (one CA for the job's control and data paths, as
  the issue asks; a certificate made for both uses serves both);
- neither: no TLS (plain gRPC, as before; the token still guards every call).

`ELASTIC_TLS_SERVER_NAME` (optional) is the name a client checks the server certificate
against instead of the address it dials: in Kubernetes a pod's IP is not known when its
certificate is made, so every node's certificate can carry one shared DNS name instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

TLS_CA_ENV = "ELASTIC_TLS_CA"
"""Path of the CA bundle that signed every node's shard-server certificate."""
TLS_CERT_ENV = "ELASTIC_TLS_CERT"
"""Path of this node's certificate (server and client)."""
TLS_KEY_ENV = "ELASTIC_TLS_KEY"
"""Path of that certificate's private key."""
TLS_SERVER_NAME_ENV = "ELASTIC_TLS_SERVER_NAME"
"""Name the server certificates carry, checked instead of the dialled address (optional)."""

# The etcd client credentials (elastic/coordinator/credentials.py; transfer may not import the
# coordinator, which is on its own layer): the fallback when no ELASTIC_TLS_* is set.
_ETCD_FALLBACK = ("ELASTIC_ETCD_CA", "ELASTIC_ETCD_CERT", "ELASTIC_ETCD_KEY")


@dataclass(frozen=True, kw_only=True)
class TlsConfig:
    """Mutual TLS of the shard server and its clients."""

    ca: str
    """Path of the CA bundle; a peer whose certificate it did not sign is refused."""
    cert: str
    """Path of this node's certificate (PEM), presented as server and as client."""
    key: str
    """Path of its private key (PEM)."""
    server_name: str | None = None
    """Name to check server certificates against instead of the dialled host (None: the host)."""

    def __post_init__(self) -> None:
        for what, path in (("CA", self.ca), ("certificate", self.cert), ("key", self.key)):
            if not os.path.isfile(path):
                raise ValueError(f"shard-transfer TLS {what} {path}: no such file")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TlsConfig | None:
        """The setting of the environment (module doc), None for plain gRPC; ValueError for a
        partial setting or a file that is not there."""
        env = os.environ if env is None else env
        names = (TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV)
        given = [env.get(n) or None for n in names]
        if not any(given):
            names = _ETCD_FALLBACK
            given = [env.get(n) or None for n in names]
            if not all(given):
                return None  # etcd without mutual TLS (or none at all): plain shard transfer
        if not all(given):
            missing = ", ".join(f"${n}" for n, v in zip(names, given, strict=True) if v is None)
            raise ValueError(f"shard-transfer TLS needs ${TLS_CA_ENV}, ${TLS_CERT_ENV} and ${TLS_KEY_ENV}; "
                             f"missing {missing}")
        ca, cert, key = (str(v) for v in given)
        return cls(ca=ca, cert=cert, key=key, server_name=env.get(TLS_SERVER_NAME_ENV) or None)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server side: present our certificate, require one the CA signed from every client."""
        return grpc.ssl_server_credentials(
            [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
            root_certificates=Path(self.ca).read_bytes(),
            require_client_auth=True,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: trust servers the CA signed, present our certificate."""
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca).read_bytes(),
            private_key=Path(self.key).read_bytes(),
            certificate_chain=Path(self.cert).read_bytes(),
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        """gRPC channel options: the server name override, when one is set."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
