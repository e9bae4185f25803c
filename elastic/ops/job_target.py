"""Which job the operator CLI talks to, and a client to its etcd that fails fast.

A job is found from, in order of precedence:

- `--etcd HOST:PORT` and `--job ID` given on the command line;
- `--run-dir DIR`: the `<DIR>/job.json` that `elastic run` writes ({"etcd", "job", "token"});
  `--etcd`/`--job` given as well override its values;
- `--etcd` alone: the only job under `/elastic/` on that etcd (several: an error naming them).

Reading a job needs no job token: the token only guards joining (see
elastic/coordinator/access.py); who may read etcd at all is etcd's own authentication.

`OpsError` is what a command reports as one line with exit code 1: etcd unreachable within
`CONNECT_TIMEOUT_S`, or no such job there (the message lists the jobs it has).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic.coordinator import schema
from elastic.coordinator.client import TRANSIENT_ERRORS, EtcdConfig
from elastic.coordinator.credentials import EtcdUnreachableError, check_access, config_from_env
from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.keys import JobKeys

CONNECT_TIMEOUT_S = 5.0
"""Deadline of each etcd call the operator CLI makes: an unreachable etcd is reported, not waited on."""

JOB_FILE = "job.json"
"""Name of the file `elastic run` writes into its run directory (see launcher.write_job_file)."""

_ROOT = schema.ROOT
_UNREACHABLE: tuple[type[BaseException], ...] = (EtcdUnreachableError, *TRANSIENT_ERRORS)


class OpsError(RuntimeError):
    """The job cannot be read: etcd unreachable, or no such job there (exit code 1)."""


class EtcdOutOfReach(OpsError):
    """etcd did not answer within CONNECT_TIMEOUT_S (a caller that knows it is coming back, such as
    `elastic inject etcd-stall` after its SIGCONT, tries again)."""


@dataclass(frozen=True, kw_only=True)
class JobTarget:
    """Where a job lives."""

    etcd: str
    """`host:port` of the job's etcd."""
    job: str | None
    """Job id; None means "the only job on that etcd"."""


def resolve_target(*, etcd: str | None, job: str | None, run_dir: str | None) -> JobTarget:
    """The target named by the command-line flags (module doc); ValueError for unusable flags."""
    if run_dir is not None:
        path = Path(run_dir) / JOB_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{path} does not exist (is {run_dir} the run dir of an elastic run?)") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from None
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("etcd"), str)
            or not isinstance(data.get("job"), str)
        ):
            raise ValueError(f"{path} must hold a JSON object with string fields etcd and job")
        etcd = etcd or _job_file_etcd(data)
        job = job or data["job"]
    if etcd is None:
        raise ValueError("give --etcd HOST:PORT or --run-dir DIR (elastic run prints both; --etcd takes HOST:PORT,HOST:PORT,... too)")
    EtcdConfig(endpoint=etcd)  # validates the host:port list
    if job is not None:
        JobKeys(job)  # validates the id
    return JobTarget(etcd=etcd, job=job)


def _job_file_etcd(data: dict[str, Any]) -> str:
    """The endpoint list of a job.json: its `etcd_endpoints` list when it has one (written since
    etcd clusters), else its `etcd` string (every job.json has it)."""
    members = data.get("etcd_endpoints")
    if isinstance(members, list) and members and all(isinstance(m, str) for m in members):
        return ",".join(members)
    return str(data["etcd"])


def open_client(target: JobTarget) -> EtcdClient:
    """A client of the target's etcd whose calls give up after CONNECT_TIMEOUT_S, without retrying:
    an operator wants to hear at once that etcd is gone, not wait out an etcd restart. With
    several members the calls retry for CONNECT_TIMEOUT_S, so that one dead member is passed over.

    Credentials come from the environment ($ELASTIC_ETCD_USER/PASSWORD/CA/CERT/KEY, see
    `config_from_env`). A credential etcd refuses, a failed TLS handshake or a user without read
    access to the job's prefix raises EtcdAccessError (a ValueError: the CLI's exit code 2);
    an etcd that does not answer, OpsError."""
    retry_s = CONNECT_TIMEOUT_S if "," in target.etcd else 0.0
    config = config_from_env(target.etcd, timeout=CONNECT_TIMEOUT_S, retry_s=retry_s)
    try:
        return check_access(config, key=JobKeys(target.job).root if target.job is not None else _ROOT, require=True)
    except _UNREACHABLE:
        raise EtcdOutOfReach(f"cannot reach etcd at {target.etcd} within {CONNECT_TIMEOUT_S:.0f} s") from None


def list_jobs(client: EtcdClient, etcd: str) -> list[str]:
    """Ids of the jobs under `/elastic/`, sorted; OpsError if etcd does not answer."""
    try:
        jobs = {
            meta.key.decode()[len(_ROOT) :].split("/", 1)[0]
            for _, meta in client.get_prefix(_ROOT, keys_only=True)
        }
    except TRANSIENT_ERRORS:
        raise EtcdOutOfReach(f"cannot reach etcd at {etcd} within {CONNECT_TIMEOUT_S:.0f} s") from None
    return sorted(j for j in jobs if j)


def _has_keys(client: EtcdClient, prefix: str, etcd: str) -> bool:
    """Whether anything lives under `prefix`; OpsError if etcd does not answer."""
    try:
        return client.get_prefix_response(prefix, count_only=True).count > 0
    except TRANSIENT_ERRORS:
        raise EtcdOutOfReach(f"cannot reach etcd at {etcd} within {CONNECT_TIMEOUT_S:.0f} s") from None


def find_job(client: EtcdClient, target: JobTarget) -> JobKeys:
    """The keys of the target's job; OpsError if etcd is unreachable or the job is not there."""
    if target.job is not None and _has_keys(client, JobKeys(target.job).root, target.etcd):
        return JobKeys(target.job)  # without listing /elastic/: a job's own etcd user may read only its prefix
    jobs = list_jobs(client, target.etcd)
    known = ", ".join(jobs) if jobs else "none"
    if target.job is None:
        if len(jobs) == 1:
            return JobKeys(jobs[0])
        if not jobs:
            raise OpsError(f"no job at etcd {target.etcd}")
        raise OpsError(f"several jobs at etcd {target.etcd}: {known}; pick one with --job")
    if target.job not in jobs:
        raise OpsError(f"job {target.job} not found at etcd {target.etcd} (jobs there: {known})")
    return JobKeys(target.job)
