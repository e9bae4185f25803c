"""A member process for the coordinator tests and bench/failure_detection.py.

    python member_proc.py ENDPOINT JOB NODE_ID OUT TTL ROLE [LIFETIME]

Every role joins the job as NODE_ID and appends one JSON line per observation to OUT:
{"event": "ready"} once its membership watch is live, then {"event": "join"|"loss", "node",
"incarnation", "t"} for each membership change (t = time.monotonic(), which all processes on
one Linux host share). Roles:
  observer   only watches;
  agent      also starts a worker child (`sleep`) guarded by watch_workers, and writes
             {"event": "worker", "pid"} before "ready";
  candidate  also campaigns for leadership and writes {"event": "leader", "t"} when it wins.
The process exits after LIFETIME seconds (default 120) so nothing outlives a broken test.
"""

import json
import subprocess
import sys
import threading
import time

from elastic.coordinator import (
    EtcdConfig,
    JobKeys,
    LeaderElection,
    Membership,
    MembershipConfig,
    NodeIdentity,
    connect,
    watch_workers,
)


def main() -> None:
    endpoint, job, node_id, out_path, ttl, role = sys.argv[1:7]
    lifetime = float(sys.argv[7]) if len(sys.argv) > 7 else 120.0
    out = open(out_path, "a", buffering=1)  # noqa: SIM115 (open for the whole life of the process)
    lock = threading.Lock()

    def emit(**record: object) -> None:
        with lock:
            out.write(json.dumps(record) + "\n")

    client = connect(EtcdConfig(endpoint=endpoint))
    keys = JobKeys(job)
    ident = NodeIdentity(node_id=node_id, incarnation=0, address="127.0.0.1:0", devices=1)
    membership = Membership(client, keys, ident, config=MembershipConfig(ttl=int(ttl)))
    watch = membership.watch(
        lambda ev: emit(
            event=ev.kind, node=ev.identity.node_id, incarnation=ev.identity.incarnation, t=ev.observed_at
        )
    )
    watch.wait_ready(10.0)
    membership.join()
    worker = None
    if role == "agent":
        worker = subprocess.Popen(["sleep", str(lifetime)])
        watch_workers(membership, [worker.pid])
        emit(event="worker", pid=worker.pid)
    if role == "candidate":
        LeaderElection(client, keys, node_id, ttl=int(ttl),
                       on_change=lambda leader: emit(event="leader_change", leader=leader,
                                                     t=time.monotonic())).start()
    emit(event="ready")
    time.sleep(lifetime)
    if worker is not None:
        worker.kill()


if __name__ == "__main__":
    main()
