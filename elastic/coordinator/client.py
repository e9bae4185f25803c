"""How to reach etcd: endpoint, credentials, TLS; and a client that survives an etcd restart.

`EtcdConfig` is what a launcher, a worker or the torchrun handler carries around; `connect()`
turns it into a `python3-etcd3` client, typed as the `EtcdClient` protocol (`etcd_api.py`). The
stock client marks an endpoint "failed" for 300 s after one UNAVAILABLE error, which would make
every call fail long after a restarted etcd is back; ours retries the endpoint at once. Its
unary calls (get, put, delete, transaction, lease grant/revoke, ...) also retry transient errors
for up to `EtcdConfig.retry_s` seconds, so an etcd restart shorter than that is invisible to
callers: they block, then succeed.

`endpoint` may list several members of one etcd cluster (`HOST:PORT,HOST:PORT,...`): `connect()`
then makes one `etcd3.Endpoint` per member and fails over between them. A member whose call
failed with a transient error is skipped for `_MEMBER_SKIP_S` seconds, so the retry goes to
another member; the retry budget (`retry_s`) is the same, so a member that dies is invisible to
callers when another one answers within it. The watches (`watch.py`, `store_waits.py`) open
their own streams on `channel` and call `fail_over` when a stream breaks.

One ambiguity remains: a transaction whose connection broke after etcd applied it is retried,
and a compare-and-swap retried that way reports failure although its first attempt succeeded.
Compare-and-swap callers already treat failure as "re-read and decide again", which covers it.

Credentials (user/password, CA, client certificate) come from the environment through
`config_from_env` (the ELASTIC_ETCD_* variables, at the end of this file), never from a command
line; `check_access` makes a first read that turns a wrong password, CA or certificate into one
line (EtcdAccessError). With a user set, an auth token etcd has let expire is renewed once per call.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import etcd3
import etcd3.exceptions
import grpc

from .etcd_api import EtcdClient

log = logging.getLogger(__name__)

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
    """`host:port` of etcd's client URL, or a comma-separated list of the client URLs of the
    members of one cluster (`host:port,host:port,...`; see `endpoints`)."""
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
    """Deadline of each unary etcd call, in seconds (of each attempt, at most `_MEMBER_ATTEMPT_S`,
    with several members)."""
    retry_s: float = 5.0
    """How long a unary call keeps retrying while etcd is unreachable (0: fail at once); an etcd
    restart shorter than this is invisible to callers."""

    def __post_init__(self) -> None:
        parse_endpoints(self.endpoint)
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd user and password must be given together")
        if (self.cert_key is None) != (self.cert_cert is None):
            raise ValueError("cert_key and cert_cert must be given together")
        if self.cert_key is not None and self.ca_cert is None:
            raise ValueError("mutual TLS (cert_key/cert_cert) needs ca_cert too")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")
        if self.retry_s < 0:
            raise ValueError(f"retry_s must be >= 0, got {self.retry_s}")

    @property
    def endpoints(self) -> tuple[tuple[str, int], ...]:
        """(host, port) of each member, in the order given."""
        return parse_endpoints(self.endpoint)

    @property
    def host(self) -> str:
        """Host of the first member."""
        return self.endpoints[0][0]

    @property
    def port(self) -> int:
        """Port of the first member."""
        return self.endpoints[0][1]


def parse_endpoints(text: str) -> tuple[tuple[str, int], ...]:
    """(host, port) of each member of `HOST:PORT[,HOST:PORT...]`; ValueError naming the first bad
    member (empty, no port, a port outside 1..65535) or a member listed twice."""
    members = [m.strip() for m in text.split(",")]
    out: list[tuple[str, int]] = []
    for member in members:
        host, sep, port = member.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"etcd endpoint must look like host:port[,host:port...], got {member!r} in {text!r}"
            )
        if (host, int(port)) in out:
            raise ValueError(f"etcd endpoint {member!r} is listed twice in {text!r}")
        out.append((host, int(port)))
    return tuple(out)


_RETRY_PAUSE_S = 0.1

_MEMBER_ATTEMPT_S = 2.0
"""With several members: the deadline of one attempt of a unary call (at most `timeout`). A write
that a follower forwarded to a leader that then died is never answered (etcd waits out the
caller's deadline), so the attempt must end early enough for the retry on another member, after
the election (about 1 s), to fit in the retry budget."""

_MEMBER_SKIP_S = 1.0
"""With several members: how long a member whose call failed is passed over for the others (with
one, it is retried at once; when every member is passed over, calls retry until one is back)."""

#: What a retried call retries: etcd3's translations of UNAVAILABLE, DEADLINE_EXCEEDED and
#: INTERNAL. A raw grpc.RpcError (NOT_FOUND for a lease that expired, ...) is an answer.
_RETRIED_ERRORS: tuple[type[BaseException], ...] = (
    etcd3.exceptions.ConnectionFailedError,
    etcd3.exceptions.ConnectionTimeoutError,
    etcd3.exceptions.InternalServerError,
    etcd3.exceptions.NoServerAvailableError,
)

_SERVER_TIMEOUTS = ("context deadline exceeded", "request timed out", "context canceled")


def server_timed_out(exc: BaseException) -> bool:
    """Whether `exc` is etcd giving up inside the server: a member that lost its quorum holds a
    linearizable read or a write until the caller's deadline, then answers with its Go context's
    error as status UNKNOWN ("context deadline exceeded"), which etcd3 passes on as a raw
    grpc.RpcError. Transient: the call succeeds once a quorum is back."""
    if not isinstance(exc, grpc.RpcError) or not callable(getattr(exc, "code", None)):
        return False
    if exc.code() != grpc.StatusCode.UNKNOWN:
        return False
    details = (exc.details() or "").lower()
    return any(text in details for text in _SERVER_TIMEOUTS)


def stop_retrying(client: object) -> None:
    """Make `client`'s calls fail at once instead of retrying for `retry_s`: for a process that
    has given etcd up (unreachable past its give-up time) and only tidies up before it exits,
    where each retried call would wait out the whole budget in vain."""
    if isinstance(client, RetryingEtcdClient):
        client.retry_s = 0.0


def etcd_unreachable(exc: BaseException) -> bool:
    """Whether `exc` says etcd could not answer right now (unreachable, no quorum, timed out):
    what a retried call raises once its retry budget is spent. A caller that can wait longer
    (the leader's loop) tries again later; any other error is an answer."""
    return isinstance(exc, _RETRIED_ERRORS) or server_timed_out(exc)


#: The client's unary calls; `get`, `get_prefix` and friends go through the `*_response` ones.
_UNARY_CALLS = (
    "get_response", "get_prefix_response", "get_range_response", "get_all_response",
    "put", "put_if_not_exists", "replace", "delete", "delete_prefix", "transaction",
    "lease", "revoke_lease", "get_lease_info", "status",
)


class RetryingEtcdClient(etcd3.MultiEndpointEtcd3Client):
    """A client whose unary calls retry transient errors for `retry_s` seconds (module doc).

    It keeps etcd3's signatures (each retried call wraps the original with `functools.wraps`),
    so it is an `EtcdClient` like the stock client (tests/coordinator/test_etcd_api.py).
    """

    retry_s: float = 0.0
    credentials: tuple[str, str] | None = None
    """(user, password) to authenticate again with when etcd forgets our token (`_renew_token`)."""


def _retrying(call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    def retried(self: RetryingEtcdClient, *args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + self.retry_s
        renewed = False
        while True:
            try:
                return call(self, *args, **kwargs)
            except (*_RETRIED_ERRORS, grpc.RpcError) as exc:
                if etcd_unreachable(exc):  # unreachable, or no quorum behind the member
                    if time.monotonic() + _RETRY_PAUSE_S > deadline:
                        raise
                    log.debug("etcd %s failed (%s); retrying", call.__name__, type(exc).__name__)
                    time.sleep(_RETRY_PAUSE_S)
                    continue
                # an auth token that expired unused (past etcd's --auth-token-ttl)
                if renewed or not isinstance(exc, grpc.RpcError) or not _renew_token(self, exc):
                    raise
                renewed = True

    return retried


for _name in _UNARY_CALLS:
    setattr(RetryingEtcdClient, _name, _retrying(getattr(etcd3.MultiEndpointEtcd3Client, _name)))


def connect(config: EtcdConfig) -> EtcdClient:
    """A client for `config`: its endpoint is retried at once after a failure, its unary calls
    for `config.retry_s` seconds."""
    secure = config.ca_cert is not None
    creds = None
    if secure:
        creds = etcd3.MultiEndpointEtcd3Client.get_secure_creds(
            config.ca_cert, config.cert_key, config.cert_cert
        )
    # -- one etcd3.Endpoint per member, failing over between them (module doc) --
    skip_s = _MEMBER_SKIP_S if len(config.endpoints) > 1 else 0.0
    endpoints = [
        etcd3.Endpoint(host, port, secure=secure, creds=creds, time_retry=skip_s, opts=_GRPC_OPTIONS)
        for host, port in config.endpoints
    ]
    timeout = min(config.timeout, _MEMBER_ATTEMPT_S) if len(endpoints) > 1 else config.timeout
    client = _authenticated(  # with a user, the constructor authenticates: retried like a call
        lambda: RetryingEtcdClient(
            endpoints=endpoints, timeout=timeout, user=config.user, password=config.password,
            failover=len(endpoints) > 1,
        ),
        config.retry_s,
    )
    client.retry_s = config.retry_s
    if config.user is not None and config.password is not None:
        client.credentials = (config.user, config.password)
    return client


# --- Credentials from the environment, and a first call that names what is wrong -------------
#
# Every process of a job (launcher, agents, workers, torchrun's rendezvous, the operator CLI)
# reaches etcd with the same credentials. They travel in the environment, never on a command
# line (a password on argv shows in `ps`): the launcher's agents and an agent's workers inherit
# the environment of the process that starts them.

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


def _tls_failed(details: str) -> bool:
    """Whether gRPC's details tell of a failed TLS handshake (not a TCP one cut short, which
    "tcp handshaker shutdown" is: a deadline under load)."""
    lowered = details.lower()
    return "tls handshake failed" in lowered or "ssl handshake failed" in lowered or "ssl_error" in lowered


def _tls_reason(details: str) -> str:
    """The SSL reason of a failed handshake (CERTIFICATE_VERIFY_FAILED, ...), else the details."""
    found = re.findall(r"OPENSSL_internal:([A-Z0-9_]+)", details)
    return found[-1] if found else details[:200]


def _access_problem(exc: grpc.RpcError, config: EtcdConfig, key: str) -> str | None:
    """One line for a refusal that retrying cannot cure, None for "unreachable right now"."""
    code, details = exc.code(), (exc.details() or "").replace("\n", " ")
    where = f"etcd at {config.endpoint}"
    if code == grpc.StatusCode.UNAVAILABLE and _tls_failed(details):
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
            if time.monotonic() + _RETRY_PAUSE_S > deadline:
                problem = _unreachable_problem(exc, config)
                if problem is not None:
                    raise EtcdAccessError(problem) from None
                if require:
                    raise EtcdUnreachableError(_unreachable_line(exc, config)) from None
                return connect(config)  # unreachable: the caller's own call says so its way
            time.sleep(_RETRY_PAUSE_S)


def _authenticated(make: Callable[[], RetryingEtcdClient], retry_s: float) -> RetryingEtcdClient:
    """`make()`, retried for `retry_s` seconds while etcd is unreachable: etcd3's constructor
    sends the Authenticate call when a user is set (a raw gRPC call, outside the retried ones)."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            return make()
        except grpc.RpcError as exc:
            transient = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            if not transient or _tls_failed(exc.details() or "") or time.monotonic() + _RETRY_PAUSE_S > deadline:
                raise
            log.debug("etcd authentication failed (%s); retrying", exc.code())
            time.sleep(_RETRY_PAUSE_S)


def _renew_token(client: RetryingEtcdClient, exc: grpc.RpcError) -> bool:
    """Authenticate `client` again when `exc` says etcd no longer knows its token: etcd's simple
    tokens expire after --auth-token-ttl (300 s) unused, and a worker may not touch etcd for
    longer than that between two failures. True when a new token is in place (retry the call)."""
    if client.credentials is None or exc.code() != grpc.StatusCode.UNAUTHENTICATED:
        return False
    if "invalid auth token" not in (exc.details() or ""):
        return False
    from etcd3 import etcdrpc
    from etcd3.client import EtcdTokenCallCredentials

    user, password = client.credentials
    reply = client.authstub.Authenticate(etcdrpc.AuthenticateRequest(name=user, password=password), client.timeout)
    client.metadata = (("token", reply.token),)
    client.call_credentials = grpc.metadata_call_credentials(EtcdTokenCallCredentials(reply.token))
    log.info("etcd forgot the auth token of user %s; authenticated again", user)
    return True


def credentials_env(config: EtcdConfig) -> dict[str, str]:
    """The ELASTIC_ETCD_* variables that give a child process `config`'s credentials (the
    inverse of config_from_env): what a process that got them another way hands on."""
    values = {ETCD_USER_ENV: config.user, ETCD_PASSWORD_ENV: config.password, ETCD_CA_ENV: config.ca_cert,
              ETCD_CERT_ENV: config.cert_cert, ETCD_KEY_ENV: config.cert_key}
    return {var: value for var, value in values.items() if value is not None}


ETCD_CREDENTIAL_ENVS = (ETCD_USER_ENV, ETCD_PASSWORD_ENV, ETCD_CA_ENV, ETCD_CERT_ENV, ETCD_KEY_ENV)
"""Every variable config_from_env reads."""


def fail_over(client: EtcdClient) -> None:
    """Pass over the member `client` is talking to (its stream broke), so that the next use of
    `client.channel` goes to another member; nothing with a single endpoint."""
    endpoints = getattr(client, "endpoints", None)
    if isinstance(endpoints, dict) and len(endpoints) > 1:
        in_use = getattr(client, "endpoint_in_use", None)
        if in_use is not None:
            in_use.fail()
