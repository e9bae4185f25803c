"""Credentials for etcd from the environment, and a first call that names what is wrong.

Every process of a job (launcher, agents, workers, torchrun's rendezvous, the operator CLI)
reaches etcd with the same credentials (user/password, CA, client certificate). They travel in
the environment (the ELASTIC_ETCD_* variables below), never on a command line (a password on
argv shows in `ps`): the launcher's agents and an agent's workers inherit the environment of
the process that starts them. `config_from_env` reads them into an `EtcdConfig` (client.py),
`credentials_env` writes them back for a child, and `check_access` makes a first read that turns
a wrong password, CA or certificate into one line (EtcdAccessError).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from typing import Any

import grpc

from .client import RETRY_PAUSE_S, EtcdConfig, connect, tls_failed
from .etcd_api import EtcdClient

ETCD_USER_ENV = "ELASTIC_ETCD_USER"
"""etcd user name (auth enabled); needs ETCD_PASSWORD_ENV."""
ETCD_PASSWORD_ENV = "ELASTIC_ETCD_PASSWORD"
"""Password of that user."""
ETCD_CA_ENV = "ELASTIC_ETCD_CA"
"""Path of the CA bundle that signed etcd's server certificate; setting it switches to TLS."""
ETCD_CERT_ENV = "ELASTIC_ETCD_CERT"
"""Path of the client certificate for etcd's --client-cert-auth (with ETCD_KEY_ENV)."""
ETCD_KEY_ENV = "ELASTIC_ETCD_KEY"
"""Path of the client certificate's private key."""


class EtcdAccessError(ValueError):
    """etcd refused us or could not be trusted: a bad credential setting, a wrong password, a
    TLS handshake that failed, a user without access to the job's keys. One line naming the
    problem; retrying cannot help."""


class EtcdUnreachableError(ConnectionError):
    """etcd did not answer within the retry time (`check_access(..., require=True)`): one line
    naming the endpoint and gRPC's reason, e.g. a refused connection."""


def config_from_env(endpoint: str, env: Mapping[str, str] | None = None, **overrides: Any) -> EtcdConfig:
    """The EtcdConfig of `endpoint` with the credentials of the environment (`env`, default
    os.environ; the ELASTIC_ETCD_* variables above); `overrides` set other fields (timeout,
    retry_s) or replace those. EtcdAccessError for a half-given pair or a file that is not there."""
    env = os.environ if env is None else env
    names = {"user": ETCD_USER_ENV, "password": ETCD_PASSWORD_ENV, "ca_cert": ETCD_CA_ENV,
             "cert_cert": ETCD_CERT_ENV, "cert_key": ETCD_KEY_ENV}
    settings: dict[str, Any] = {field: env.get(var) or None for field, var in names.items()}
    settings.update(overrides)
    for field in ("ca_cert", "cert_cert", "cert_key"):
        path = settings[field]
        if path is not None and not os.path.isfile(path):
            raise EtcdAccessError(f"${names[field]}={path}: no such file")
    try:
        return EtcdConfig(endpoint=endpoint, **settings)
    except ValueError as exc:
        if str(exc).startswith("etcd endpoint"):
            raise
        raise EtcdAccessError(f"etcd credentials from the environment: {exc} "
                              f"(${ETCD_USER_ENV}/${ETCD_PASSWORD_ENV}, ${ETCD_CERT_ENV}/${ETCD_KEY_ENV}, "
                              f"${ETCD_CA_ENV})") from None


def _tls_reason(details: str) -> str:
    """The SSL reason of a failed handshake (CERTIFICATE_VERIFY_FAILED, ...), else the details."""
    found = re.findall(r"OPENSSL_internal:([A-Z0-9_]+)", details)
    return found[-1] if found else details[:200]


def _access_problem(exc: grpc.RpcError, config: EtcdConfig, key: str) -> str | None:
    """One line for a refusal that retrying cannot cure, None for "unreachable right now"."""
    code, details = exc.code(), (exc.details() or "").replace("\n", " ")
    where = f"etcd at {config.endpoint}"
    if code == grpc.StatusCode.UNAVAILABLE and tls_failed(details):
        hint = f"check ${ETCD_CA_ENV}, ${ETCD_CERT_ENV} and ${ETCD_KEY_ENV}"
        if config.ca_cert is None:
            hint = f"does it serve TLS? then set ${ETCD_CA_ENV}"
        return f"TLS handshake with {where} failed: {_tls_reason(details)} ({hint})"
    if code == grpc.StatusCode.INVALID_ARGUMENT and "authentication failed" in details:
        return f"{where} refused user {config.user!r}: {details} (check ${ETCD_USER_ENV} and ${ETCD_PASSWORD_ENV})"
    if code == grpc.StatusCode.FAILED_PRECONDITION and "authentication is not enabled" in details:
        return f"{where} has authentication off but ${ETCD_USER_ENV} is set: unset it, or enable auth there"
    if code == grpc.StatusCode.PERMISSION_DENIED:
        if config.user is None:
            return (f"{where} refused to let us read {key} ({details}): it has authentication on; "
                    f"set ${ETCD_USER_ENV} and ${ETCD_PASSWORD_ENV}")
        return f"{where}: user {config.user!r} may not read {key} ({details}); grant its role readwrite on that prefix"
    return None


def _unreachable_problem(exc: grpc.RpcError, config: EtcdConfig) -> str | None:
    """After the retries: one line for an etcd that answers every connection by closing it (a
    TLS etcd dialled in plain text, or the reverse), None for one that is just not there."""
    details = exc.details() or ""
    # A plain-text etcd resets a TLS client's handshake: gRPC says "Socket closed" or, as seen once
    # in CI, "Handshake read failed (recvmsg:Connection reset by peer)".
    if exc.code() == grpc.StatusCode.UNAVAILABLE and ("Socket closed" in details or "Handshake read failed" in details):
        if config.ca_cert is None:
            return f"etcd at {config.endpoint} closes every plain-text connection: does it serve TLS? then set ${ETCD_CA_ENV}"
        return f"etcd at {config.endpoint} closes every connection: does it serve TLS? (${ETCD_CA_ENV} is set)"
    return None


def _unreachable_line(exc: grpc.RpcError, config: EtcdConfig) -> str:
    """One line for an etcd that did not answer: the endpoint, gRPC's reason (its last clause,
    e.g. "Connection refused") and what to check."""
    details = (exc.details() or str(exc.code())).replace("\n", " ")
    reason = details.rsplit(": ", 1)[-1].strip()[:120]
    return (f"etcd at {config.endpoint} did not answer within {config.retry_s:g} s ({reason}): is etcd running "
            "there, and is the endpoint right?")


def check_access(config: EtcdConfig, *, key: str, require: bool = False) -> EtcdClient:
    """A client of `config` after one read of `key` (e.g. the job's prefix) succeeded, so that a
    wrong password, a wrong CA, a missing client certificate or a role without that prefix is
    reported (EtcdAccessError, one line) before anything is written. An etcd that does not answer
    is retried for `config.retry_s` and then left to the caller's first call to report, or, with
    `require`, reported as EtcdUnreachableError (one line); either after at most `retry_s` plus
    one call's `timeout` (a refused connection fails each attempt at once)."""
    from etcd3 import etcdrpc, utils

    deadline = time.monotonic() + config.retry_s
    while True:
        try:
            client: Any = connect(config)  # authenticates here when a user is set
            try:
                request = etcdrpc.RangeRequest(key=key.encode(), range_end=utils.prefix_range_end(key.encode()),
                                               limit=1, keys_only=True)
                client.kvstub.Range(request, config.timeout, credentials=client.call_credentials,
                                    metadata=client.metadata)
                return client
            except BaseException:
                client.close()
                raise
        except grpc.RpcError as exc:
            problem = _access_problem(exc, config, key)
            if problem is not None:
                raise EtcdAccessError(problem) from None
            if time.monotonic() + RETRY_PAUSE_S > deadline:
                problem = _unreachable_problem(exc, config)
                if problem is not None:
                    raise EtcdAccessError(problem) from None
                if require:
                    raise EtcdUnreachableError(_unreachable_line(exc, config)) from None
                return connect(config)  # unreachable: the caller's own call says so its way
            time.sleep(RETRY_PAUSE_S)


def credentials_env(config: EtcdConfig) -> dict[str, str]:
    """The ELASTIC_ETCD_* variables that give a child process `config`'s credentials (the
    inverse of config_from_env): what a process that got them another way hands on."""
    values = {ETCD_USER_ENV: config.user, ETCD_PASSWORD_ENV: config.password, ETCD_CA_ENV: config.ca_cert,
              ETCD_CERT_ENV: config.cert_cert, ETCD_KEY_ENV: config.cert_key}
    return {var: value for var, value in values.items() if value is not None}


ETCD_CREDENTIAL_ENVS = (ETCD_USER_ENV, ETCD_PASSWORD_ENV, ETCD_CA_ENV, ETCD_CERT_ENV, ETCD_KEY_ENV)
"""Every variable config_from_env reads."""
