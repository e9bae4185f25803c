"""Job access: a shared secret (the job token) that a node must present to join.

The first node of a job stores a salted PBKDF2 hash of the token under `token` (create-only
transaction, so two first nodes cannot install different tokens); every later node must present
a token with the same hash or gets `JobAccessError` before it writes anything else, so a
misconfigured node never disturbs the running job. A job without a token accepts only nodes
without one. etcd's own user/password and TLS settings travel in `EtcdConfig`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

from .etcd_api import EtcdClient
from .keys import JobKeys

_ITERATIONS = 100_000


class JobAccessError(PermissionError):
    """A node presented a wrong (or missing) job token."""


def _hash(token: str, salt: bytes) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", token.encode(), salt, _ITERATIONS)


def admit(client: EtcdClient, keys: JobKeys, token: str | None) -> None:
    """Install the job's token hash (first node) or check `token` against it (everyone else).

    The stored record is read first: a node of a running job computes one PBKDF2 (the check),
    not two (a hash to install that the job already has: 0.1 s of a core each, at every agent's,
    worker's and command's start). Only a job without a record hashes to install one."""
    value, _ = client.get(keys.token)
    if value is None:
        salt = os.urandom(16)
        record = json.dumps(
            {"salt": salt.hex(), "hash": _hash(token, salt).hex() if token else "", "iterations": _ITERATIONS}
        )
        txn = client.transactions
        installed, responses = client.transaction(
            compare=[txn.create(keys.token) == 0],
            success=[txn.put(keys.token, record)],
            failure=[txn.get(keys.token)],
        )
        if installed:
            return
        value = responses[0][0][0]  # another first node installed its record in between: check against it
    _check(keys, token, json.loads(value))


def _check(keys: JobKeys, token: str | None, stored: dict[str, Any]) -> None:
    """JobAccessError unless `token` matches the installed record `stored`."""
    if not stored["hash"]:
        if token:
            raise JobAccessError(
                f"job {keys.job!r} was started without a job token, but this node presented one"
            )
        return
    if not token:
        raise JobAccessError(f"job {keys.job!r} requires a job token (set ELASTIC_JOB_TOKEN or token=...)")
    digest = hashlib.pbkdf2_hmac(
        "sha256", token.encode(), bytes.fromhex(stored["salt"]), stored["iterations"]
    )
    if not hmac.compare_digest(digest.hex(), stored["hash"]):
        raise JobAccessError(f"wrong job token for job {keys.job!r}: this node is not admitted")
