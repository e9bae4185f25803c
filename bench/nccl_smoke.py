"""The NCCL path's first run on a GPU: the runtime's communicators on size-1 groups (one GPU
cannot hold two ranks of one communicator), each check one line of JSON's `checks`.

    python -m bench.nccl_smoke                       # CUDA + NCCL, both modes
    python -m bench.nccl_smoke --device cpu          # the gloo path of the same script (the suite runs it)

For each NCCL mode (blocking, the default, and `ELASTIC_NCCL_NONBLOCKING=1`: elastic/comm/
opening.py), in a process of its own run with torch's and NCCL's INFO logs on:

1. `open_communicator`, then an all-reduce and a fetch of its result (risk 1 of issue 60: a first
   operation after the connect; "NCCL Error 7: operation in progress" would fail it);
2. the group's bound device and name (risks 2 and 7), and the INFO log's lines about the groups
   (bound device, blocking mode, the names in the log prefix);
3. `--generations` generations of create, use, retire, each timed, with the device's used memory
   after each (risk 8: communicators' memory and creation time per generation);
4. an abort from a second thread while the group is idle, and while it is busy (an all-reduce
   queued behind a long kernel), each timed; a wait after the abort (risk 4: StepAborted, not a
   backend error, through `wait_work`); shutdown after abort (risk 3: returns);
5. the exchange's side stream is of high priority, so never one of NCCL's (risk 6).

Prints one JSON (also to `--json FILE`); exit 1 when a check fails. On the CPU the gloo path runs
(the mode only changes what the recording says), so that the script cannot rot where no GPU is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from elastic.comm import NONBLOCKING_ENV, Communicator, open_communicator
from elastic.comm.device import bind_thread, side_stream, synchronize
from elastic.parallel.abort import AbortSignal, StepAborted, fetch, wait_work

MODES = {"blocking": "0", "nonblocking": "1"}
LOG_PATTERN = re.compile(r"ProcessGroupNCCL|NCCL version|[Ee]ager|bound|[Bb]locking|PG ID|group_name|elastic g")
TIMEOUT = timedelta(seconds=60)
MIB = 1 << 20


def used_memory(device: torch.device) -> int:
    """Bytes in use on the device (CUDA: the driver's figure, which counts NCCL's buffers beside
    the allocator's) or, on the CPU, this process's resident set."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total - free)
    return int(psutil.Process().memory_info().rss)


def _open(name: str, backend: str, device: torch.device) -> Communicator:
    return open_communicator(dist.HashStore(), name=name, members=[0], rank=0, backend=backend, device=device,
                             timeout=TIMEOUT)


def _use(comm: Communicator, numel: int = 1 << 20) -> bool:
    """An all-reduce of a tensor of ones, and its result read on the host (size 1: unchanged)."""
    tensor = torch.ones(numel, device=comm.device)
    wait_work(comm.all_reduce(tensor), None)
    return bool(torch.all(fetch(tensor, None) == 1.0))


def sequence_collectives(comm: Communicator) -> bool:
    """Sequence parallelism's collectives (model/collectives.py): a reduce-scatter (the name this
    torch gives it) and an all-gather of one rank, each its input back."""
    x = torch.arange(8.0, device=comm.device)
    out = torch.empty_like(x)
    wait_work(comm.reduce_scatter(out, x), None)
    parts = [torch.empty_like(x)]
    wait_work(comm.all_gather(parts, x), None)
    return bool(torch.equal(fetch(out, None), fetch(x, None)) and torch.equal(fetch(parts[0], None), fetch(x, None)))


def first_use(backend: str, device: torch.device) -> dict[str, Any]:
    start = time.perf_counter()
    comm = _open("smoke/first", backend, device)
    opened = time.perf_counter()
    ok = _use(comm)
    out = {"open_s": opened - start, "first_use_s": time.perf_counter() - opened, "result_ok": ok,
           "sequence_collectives_ok": sequence_collectives(comm),
           "bound_device": str(comm.group.bound_device_id), "group_name": comm.group.group_name,
           "group_desc": comm.group.group_desc}
    comm.shutdown()
    return out


def generations(backend: str, device: torch.device, count: int) -> dict[str, Any]:
    rows = []
    base = used_memory(device)
    for g in range(count):
        t0 = time.perf_counter()
        comm = _open(f"g{g + 1}/world", backend, device)
        t1 = time.perf_counter()
        ok = _use(comm, 1 << 16)
        t2 = time.perf_counter()
        comm.shutdown()
        synchronize(device)
        t3 = time.perf_counter()
        rows.append({"generation": g + 1, "create_s": t1 - t0, "use_s": t2 - t1, "retire_s": t3 - t2, "ok": ok,
                     "used_mib": (used_memory(device) - base) / MIB})
    return {"rows": rows, "create_s_max": max(r["create_s"] for r in rows),
            "used_mib_growth": rows[-1]["used_mib"] - rows[0]["used_mib"] if rows else 0.0}


def _busy(comm: Communicator) -> Any:
    """An all-reduce queued behind a long kernel (CUDA), so that an abort finds it pending."""
    if comm.device.type == "cuda":
        torch.cuda._sleep(int(2e9))  # private, test-only: about a second of spinning on the stream
    return comm.all_reduce(torch.ones(1 << 20, device=comm.device))


def abort_from_thread(backend: str, device: torch.device, *, busy: bool) -> dict[str, Any]:
    comm = _open(f"abort/{'busy' if busy else 'idle'}", backend, device)
    _use(comm, 16)
    handle = _busy(comm) if busy else None
    abort = AbortSignal()
    abort.on_hard(comm.abort)
    took: dict[str, float] = {}

    def make_it_hard() -> None:
        bind_thread(device)
        t = time.perf_counter()
        abort.set("smoke: abort from a second thread")
        took["abort_s"] = time.perf_counter() - t

    thread = threading.Thread(target=make_it_hard, name="aborter")
    thread.start()
    thread.join(TIMEOUT.total_seconds())
    waited = raw = "no work"
    if handle is not None:
        try:  # what torch's own wait does on an aborted group (NCCL: a backend error, or nothing)
            handle.complete()
            raw = "returned"
        except Exception as exc:
            raw = f"{type(exc).__name__}: {exc}"
        try:
            wait_work(handle, abort)
            waited = "returned"
        except StepAborted:
            waited = "StepAborted"
        except Exception as exc:  # what issue 60's risk 4 is about: reported, not raised
            waited = f"{type(exc).__name__}: {exc}"
    t = time.perf_counter()
    closed = comm.shutdown()
    return {"abort_returned": not thread.is_alive(), "abort_s": took.get("abort_s"), "wait_after_abort": waited,
            "raw_wait_after_abort": raw,
            "shutdown_s": time.perf_counter() - t, "shutdown_closed": closed,
            "abort_error": None if comm.abort_error is None else repr(comm.abort_error)}


def stream_priority(device: torch.device) -> dict[str, Any]:
    stream = side_stream(device)
    if stream is None:
        return {"side_stream": None}
    return {"side_stream_priority": stream.priority, "priority_range": list(torch.cuda.Stream.priority_range())}


def child(device_name: str, count: int) -> dict[str, Any]:
    device = torch.device(device_name)
    backend = "nccl" if device.type == "cuda" else "gloo"
    bind_thread(device)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else None
    return {"backend": backend, "torch": torch.__version__, "nccl": nccl, "mode_env": os.environ.get(NONBLOCKING_ENV),
            "first": first_use(backend, device), "generations": generations(backend, device, count),
            "abort_idle": abort_from_thread(backend, device, busy=False),
            "abort_busy": abort_from_thread(backend, device, busy=True), "streams": stream_priority(device)}


def checks(mode: str, device: torch.device, r: dict[str, Any]) -> list[dict[str, Any]]:
    """Each risk of issue 60 this run can check, as (risk, what, ok)."""
    cuda = device.type == "cuda"
    first, busy, idle = r["first"], r["abort_busy"], r["abort_idle"]
    out = [
        (1, "a first all-reduce right after open_communicator, and its result", first["result_ok"]),
        (2, "the group is bound to the device", first["bound_device"] == (str(device) if cuda else "None")),
        (3, "an abort from a second thread returns, idle and busy",
         idle["abort_returned"] and busy["abort_returned"]),
        (3, "shutdown after abort returns", idle["shutdown_closed"] and busy["shutdown_closed"]),
        (4, "a wait on work the abort ended is StepAborted", busy["wait_after_abort"] in ("StepAborted", "returned")),
        (6, "the side stream is of high priority",
         not cuda or r["streams"]["side_stream_priority"] == min(r["streams"]["priority_range"])),
        (7, "the group carries its name", first["group_name"] == "smoke/first"),
        (8, "every generation made, used and retired", all(g["ok"] for g in r["generations"]["rows"])),
        (9, "sequence parallelism's reduce-scatter and all-gather", first["sequence_collectives_ok"]),
    ]
    return [{"mode": mode, "risk": risk, "what": what, "ok": bool(ok)} for risk, what, ok in out]


def run_mode(mode: str, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    env = dict(os.environ, **{NONBLOCKING_ENV: MODES[mode], "TORCH_CPP_LOG_LEVEL": "INFO",
                              "TORCH_DISTRIBUTED_DEBUG": "INFO", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"})
    repo = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = f"{repo}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(repo)
    cmd = [sys.executable, "-m", "bench.nccl_smoke", "--child", "--device", args.device,
           "--generations", str(args.generations)]
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=args.timeout)
    log = [line for line in proc.stderr.splitlines() if LOG_PATTERN.search(line)][:args.log_lines]
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-4000:]}, log
    return json.loads(proc.stdout.splitlines()[-1]), log


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (NCCL) or cpu (gloo); default cuda")
    parser.add_argument("--generations", type=int, default=20)
    parser.add_argument("--modes", default="blocking,nonblocking", help="comma-separated: blocking, nonblocking")
    parser.add_argument("--json", type=Path, help="also write the JSON here")
    parser.add_argument("--timeout", type=float, default=240, help="seconds for each mode's process")
    parser.add_argument("--log-lines", type=int, default=60, help="INFO log lines kept per mode")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.device, args.generations)), flush=True)
        return 0
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or args.device.split(":")[0] not in ("cuda", "cpu"):
        parser.error(f"unknown mode(s) {unknown} or device {args.device!r}")
    result: dict[str, Any] = {"device": args.device, "modes": {}, "checks": []}
    for mode in modes:
        got, log = run_mode(mode, args)
        result["modes"][mode] = {**got, "torch_log": log}
        result["checks"] += (checks(mode, torch.device(args.device), got) if "error" not in got
                             else [{"mode": mode, "risk": 0, "what": "the mode's process ran", "ok": False}])
    result["ok"] = all(c["ok"] for c in result["checks"])
    text = json.dumps(result, indent=1)
    if args.json is not None:
        args.json.write_text(text)
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
