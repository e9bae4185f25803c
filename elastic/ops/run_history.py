"""The history of an elastic run, kept in its run directory once the job and its etcd are gone.

When the job ends, however it ends, `elastic run` reads the job's events (`elastic events`) and
its status (`elastic status`) from its etcd before that etcd stops, and writes them with how the
run ended into `<run_dir>/history/`:

    events.json   [HistoryEvent, ...] as `elastic events --json` prints them, oldest first
    status.json   the JobStatus `elastic status --json` printed at that moment
    end.json      RunEnd (elastic/records/run_end.py): how it ended, when, the launcher's pid;
                  written last, so its presence says the other two are whole

Each file is written to a temporary name and renamed into place. `elastic status --run-dir` and
`elastic events --run-dir` read them once the run has ended (`find_ended_run`). A launcher that
was SIGKILLed wrote nothing at its end: its run directory still holds its etcd's data
(`<run_dir>/etcd`), so the history is read back from a *copy* of that data directory, opened by
a temporary etcd of its own (a member of a cluster opens alone: `recover_history`) on a free
loopback port, exactly as from the live job, and the run is reported as ended without its
launcher writing an end. The copy's leases are revoked before its status is read: nothing of
that job is alive any more.

A run has ended when its launcher is gone (the run directory's lock, elastic/ops/run_lock.py,
is not held) or, where no launcher recorded itself there, when the etcd of its job.json does not
answer. A saved history is that run's when no launcher took the directory after writing it (a
dead launcher's lock record started later: that launcher was killed, and its own history is
read from the etcd data). A live launcher's run is read from its etcd, as before.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elastic.coordinator.client import TRANSIENT_ERRORS, EtcdConfig, connect
from elastic.coordinator.etcd_api import EtcdClient
from elastic.coordinator.etcd_server import EtcdServer
from elastic.coordinator.jsonrecord import RecordError, from_data, to_data
from elastic.coordinator.keys import JobKeys
from elastic.ops.events import History, HistoryEvent
from elastic.ops.job_target import OpsError
from elastic.ops.run_lock import probe
from elastic.ops.status import JobStatus
from elastic.ops.status_read import read_status
from elastic.records.run_end import RunEnd

HISTORY_DIR = "history"
EVENTS_FILE = "events.json"
STATUS_FILE = "status.json"
END_FILE = "end.json"
ETCD_DIR = "etcd"
"""Where the launcher's own etcd keeps its data in the run directory (launcher._start_etcd)."""
_COPY_ERRORS: tuple[type[BaseException], ...] = (OSError, RuntimeError, TimeoutError, *TRANSIENT_ERRORS)
"""What opening and reading a copy of the etcd data may raise (no binary, etcd exits, no answer)."""
_COPY_FLAGS = ("--heartbeat-interval", "10", "--election-timeout", "100")
"""The temporary etcd of a copied data directory elects itself in 0.1 s instead of etcd's default
1 s (it serves one reader on loopback, for a moment)."""
_MEMBER_FLAGS = ("--force-new-cluster",)
"""And a copy of one member of a cluster opens as a cluster of its own (alone, it has no quorum)."""


@dataclass(frozen=True, kw_only=True)
class EndedRun:
    """What `elastic status` and `elastic events` show of a run that has ended."""

    end: RunEnd
    """How it ended."""
    events: list[HistoryEvent]
    """Its history, oldest first, as `elastic events` read it from the job's etcd."""
    status: JobStatus
    """Its last status, with `ended` set."""


# ---- writing (the launcher, at the end of the job) ----------------------------------------


def snapshot(client: EtcdClient, keys: JobKeys, *, etcd: str) -> tuple[list[HistoryEvent], JobStatus]:
    """The job's history and status, read from its etcd (etcd errors propagate)."""
    return History(client, keys).read_all(), read_status(client, keys, etcd=etcd)


def save_history(run_dir: Path, *, events: list[HistoryEvent], status: JobStatus, end: RunEnd) -> Path:
    """Write `<run_dir>/history/` (module doc); returns that directory."""
    directory = run_dir / HISTORY_DIR
    directory.mkdir(parents=True, exist_ok=True)
    _write_atomic(directory / EVENTS_FILE, json.dumps([to_data(e) for e in events], indent=1, sort_keys=True))
    _write_atomic(directory / STATUS_FILE, status.to_json())
    _write_atomic(directory / END_FILE, end.to_json(indent=1))
    return directory


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---- reading (the operator CLI) -------------------------------------------------------------


def load_history(run_dir: Path) -> EndedRun | None:
    """The history the launcher wrote at the end, or None if there is none; OpsError if unreadable."""
    directory = run_dir / HISTORY_DIR
    try:
        end = RunEnd.from_json((directory / END_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, RecordError) as exc:
        raise OpsError(f"cannot read {directory / END_FILE}: {exc}") from None
    try:
        events = [from_data(HistoryEvent, e) for e in json.loads((directory / EVENTS_FILE).read_text())]
        status = from_data(JobStatus, json.loads((directory / STATUS_FILE).read_text()))
    except (OSError, ValueError) as exc:  # RecordError and JSONDecodeError are ValueErrors
        raise OpsError(f"cannot read the history in {directory}: {exc}") from None
    return EndedRun(end=end, events=events, status=dataclasses.replace(status, ended=end.to_dict()))


def find_ended_run(run_dir: Path, *, job: str, etcd: str, etcd_answers: Callable[[], bool]) -> EndedRun | None:
    """The ended run in `run_dir` (module doc), or None while it is live (read it from its etcd).
    `etcd_answers()` says whether the job.json's etcd answers; it is asked only where no launcher
    recorded itself in the run directory. OpsError if the history cannot be read."""
    lock = probe(run_dir)
    record = lock.record if lock is not None else None
    saved = load_history(run_dir)
    ours = saved is not None and record is not None and saved.end.launcher_pid == record.pid
    if lock is not None and lock.held and not ours:
        return None  # live (a launcher that wrote its end is only tidying up: `ours`)
    if saved is not None and (record is None or ours or record.started_at < (saved.end.at or 0.0)):
        return saved  # (a later launcher that left a record, but no end, was killed: not its history)
    if record is not None and not record.embedded_etcd:
        return None  # an external etcd outlives the launcher: the job's history is still there
    if not etcd_data_dirs(run_dir) or (record is None and etcd_answers()):
        return None
    return recover_history(run_dir, job=job, etcd=etcd, launcher_pid=record.pid if record is not None else None)


def etcd_data_dirs(run_dir: Path) -> list[Path]:
    """The data directories of the launcher's own etcd in `run_dir`: one, or one per member of a
    local cluster (`--etcd-members`); empty if there is none."""
    base = run_dir / ETCD_DIR
    if (base / "data" / "member").is_dir():
        return [base / "data"]
    return sorted(m.parent for m in base.glob("member-*/data/member"))


def recover_history(run_dir: Path, *, job: str, etcd: str, launcher_pid: int | None) -> EndedRun:
    """The history of a run whose launcher wrote none, read from a copy of its etcd's data by a
    temporary etcd of its own (module doc). Of a cluster, each member's copy opens alone
    (`--force-new-cluster`), which keeps only the entries it knew as committed: the copy with the
    latest revision is read (writes of the last heartbeat, 0.1 s, before all members died may be
    missing there; a single etcd replays its whole log). OpsError if that fails."""
    candidates = etcd_data_dirs(run_dir)
    flags = _COPY_FLAGS + (_MEMBER_FLAGS if len(candidates) > 1 else ())
    if not candidates:
        raise OpsError(f"the run in {run_dir} has ended, and it has neither a history nor etcd data ({run_dir / ETCD_DIR})")
    best: tuple[int, EndedRun] | None = None
    for data in candidates:
        end = RunEnd(how="launcher gone", detail=f"read from a copy of {data}", launcher_pid=launcher_pid,
                     source="etcd copy")
        try:
            revision, ended = _read_copy(data, JobKeys(job), etcd=etcd, end=end, flags=flags)
        except OpsError:
            if len(candidates) == 1:
                raise
            continue  # another member may hold the job
        except _COPY_ERRORS as exc:
            raise OpsError(f"the run in {run_dir} has ended without its launcher writing its history, and "
                           f"reading a copy of {data} failed: {exc}") from None
        if best is None or revision > best[0]:
            best = (revision, ended)
    if best is None:
        raise OpsError(f"job {job} is not in the etcd data of {run_dir}")
    return best[1]


def _read_copy(data: Path, keys: JobKeys, *, etcd: str, end: RunEnd,
               flags: tuple[str, ...]) -> tuple[int, EndedRun]:
    """(the copy's revision, the history read from it, then, every lease revoked, since nothing
    of the job is alive, the status) of a copy of the data directory `data`, opened by an etcd
    with `flags`."""
    with tempfile.TemporaryDirectory(prefix="elastic-history-") as tmp:
        shutil.copytree(data, Path(tmp) / "data", ignore=shutil.ignore_patterns("*.tmp"))
        server = EtcdServer(data_dir=tmp, auto_compaction=None, extra_args=flags)
        try:
            server.start()
            client = connect(EtcdConfig(endpoint=server.endpoint, retry_s=0.0))
            try:
                found = client.get_prefix_response(keys.root, count_only=True)
                if found.count == 0:
                    raise OpsError(f"job {keys.job} is not in the etcd data of {data}")
                events = History(client, keys).read_all()
                leases = {meta.lease_id for _, meta in client.get_prefix(keys.root, keys_only=True) if meta.lease_id}
                for lease in leases:
                    client.revoke_lease(lease)
                status = read_status(client, keys, etcd=etcd)
            finally:
                client.close()
        finally:
            server.stop()
    ended = EndedRun(end=end, events=events, status=dataclasses.replace(status, ended=end.to_dict()))
    return int(found.header.revision), ended


def end_event(ended: EndedRun) -> HistoryEvent:
    """The last line of an ended run's `elastic events`: how it ended (kind "ended", by the
    launcher; no etcd key: it is the run directory's account, at the last event's revision)."""
    detail = {k: v for k, v in ended.end.to_dict().items() if k != "at"}
    revision = max((e.revision for e in ended.events), default=0)
    return HistoryEvent(kind="ended", time=ended.end.at, who="launcher", revision=revision, key="", detail=detail)
