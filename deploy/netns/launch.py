"""Run an elastic job with each node in its own network namespace (root only).

    sudo .venv/bin/python deploy/netns/launch.py --nodes 3 --fault-tolerance 1 --steps 20 \\
        --partition node=2,step=8,seconds=6

Takes the flags of `elastic run` (same parser), plus --partition (a downed link, or with
mode=oneway a one-way partition: nothing the node sends reaches etcd), --sick-link (delay and
loss on a node's link, see sicklink.py) and --check. It builds a
bridge and one namespace per node (topology.py), starts etcd on the bridge address, optionally
checks that gloo and gRPC work between namespaces (probe.py), then runs the job with
`launch_elastic`: each node's agent (and so its workers) runs under `ip netns exec`, with
ELASTIC_HOST = the node's address and GLOO_SOCKET_IFNAME = its interface. Whatever happens
(success, failure, Ctrl-C, SIGTERM) it stops every process it started, by PID, and deletes the
namespaces, veths and bridge. A stop that `elastic drain --all` asks for (the job's etcd is
on the bridge address) ends the job at a step boundary with a checkpoint there, as under `elastic
run`: the summary is written, and the final state is that checkpoint's parameters. Exit codes: 0
done, 1 the job or the check failed, 2 bad flags or no root / no `ip netns`, 3 stopped on
request, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partition import Partitioner, PartitionSpec, parse_partition, parse_sick_link
from topology import NetnsUnavailable, Topology, check_available

if TYPE_CHECKING:
    from elastic.roles.interrupt import Interrupt

PROBE = Path(__file__).with_name("probe.py")


class _OneParser:
    """Stands in for argparse subparsers so that `elastic run`'s register() fills our parser."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return self.parser


def build_parser() -> argparse.ArgumentParser:
    from elastic.cli import run_cmd

    parser = argparse.ArgumentParser(
        prog="deploy/netns/launch.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run_cmd.register(_OneParser(parser))
    parser.add_argument(
        "--partition", action="append", default=[], metavar="node=N,step=S,seconds=D[,mode=oneway]",
        help="down node N's link while step S is in flight, for D seconds; mode=oneway: drop only what "
             "node N sends to etcd (it still hears etcd and its peers); repeatable",
    )
    parser.add_argument(
        "--sick-link", action="append", default=[], metavar="node=N,step=S,seconds=D,delay=MS,loss=PCT",
        help="from step S on, for D seconds, delay each frame of node N's link by MS ms and drop PCT %% "
             "of them, in each direction; repeatable",
    )
    parser.add_argument(
        "--check", action="store_true", help="first check gloo and gRPC between the namespaces"
    )
    return parser


def _interrupt_on_signals() -> Interrupt:
    """SIGINT and SIGTERM stop at once (exit 130). While `launch_elastic` runs they only ask its
    Interrupt, which it raises where no gRPC lock is held (elastic/roles/interrupt.py); before and
    after, KeyboardInterrupt unwinds through the cleanup of `_run`."""
    from elastic.roles.interrupt import Interrupt

    interrupt = Interrupt()

    def handler(signum: int, frame: object) -> None:
        interrupt.stop_at_once(signum, ignore=(signal.SIGINT, signal.SIGTERM),
                               outside=lambda stop: KeyboardInterrupt(f"signal {stop.signum}"))

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return interrupt


def run_probe(topo: Topology, etcd: str, *, timeout_s: float = 90.0) -> list[str]:
    """Run probe.py in every namespace at once; their report lines, or RuntimeError."""
    procs = []
    try:
        for m in topo.members:
            cmd = [*m.exec_prefix(), sys.executable, str(PROBE), "--etcd", etcd, "--prefix", topo.prefix,
                   "--rank", str(m.node), "--world", str(len(topo.members))]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          env=dict(os.environ, **m.env())))
        lines = []
        deadline = time.monotonic() + timeout_s
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            lines.append(
                out.decode(errors="replace").strip().splitlines()[-1] if out.strip() else "(no output)"
            )
            if p.returncode != 0:
                raise RuntimeError(f"cross-namespace check failed: {lines[-1]}")
        return lines
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_available()
    except NetnsUnavailable as exc:
        print(f"deploy/netns/launch.py: {exc}", file=sys.stderr)
        return 2
    try:
        config, partitions = _job_config(args)
    except ValueError as exc:  # UsageError is a ValueError
        print(f"deploy/netns/launch.py: error: {exc}", file=sys.stderr)
        return 2
    interrupt = _interrupt_on_signals()
    try:
        return _run(args, config, partitions, interrupt)
    except KeyboardInterrupt:
        print("deploy/netns/launch.py: interrupted; everything stopped and removed", file=sys.stderr)
        return 130


def _job_config(args: argparse.Namespace) -> tuple[Any, list[PartitionSpec]]:
    """The ElasticConfig of `elastic run` with these flags, and the partitions (ValueError if bad)."""
    from elastic.cli.model_flags import model_for_data
    from elastic.cli.run_config import build_plan, elastic_config, job_spec

    if args.static or args.etcd is not None:
        raise ValueError("--static and --etcd do not apply: this launcher runs its own etcd on the bridge")
    if args.steps < 0:
        raise ValueError(f"--steps must be >= 0, got {args.steps}")
    cfg = model_for_data(args)  # --model, --model-config, --n-layer ...; prepared --data: its vocabulary
    planned = build_plan(args, shape=cfg)
    plan = planned.plan
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="elastic-netns-"))
    args.run_dir = run_dir
    spec = job_spec(args, planned, run_dir, shape=cfg)  # elastic run's: every flag of its JobSpec
    config = elastic_config(args, spec, planned)
    partitions = [parse_partition(text) for text in args.partition]
    partitions += [parse_sick_link(text) for text in args.sick_link]
    for p in partitions:
        if p.node not in plan.nodes:
            raise ValueError(f"{_flag(p)} node {p.node} is not a node of the plan ({sorted(plan.nodes)})")
        if p.step > args.steps:
            raise ValueError(f"{_flag(p)} step {p.step} is past the last step ({args.steps})")
    return config, partitions


def _flag(spec: PartitionSpec) -> str:
    return "--sick-link" if spec.mode == "sick" else "--partition"


def _fault_setter(topo: Topology, etcd_host: str) -> Callable[[PartitionSpec, bool], None]:
    """The Partitioner's `set_fault`: each mode of PartitionSpec mapped onto the topology."""

    def set_fault(spec: PartitionSpec, on: bool) -> None:
        if spec.mode == "sick":
            if on:
                topo.sicken(spec.node, delay_ms=spec.delay_ms, loss=spec.loss, seed=spec.step)
            else:
                topo.heal(spec.node)
        elif spec.mode == "oneway":
            topo.set_one_way(spec.node, etcd_host, cut=on)
        else:
            topo.set_link(spec.node, up=not on)

    return set_fault


def _run(args: argparse.Namespace, config: Any, partitions: list[PartitionSpec], interrupt: Interrupt) -> int:
    from elastic.coordinator import EtcdServer
    from elastic.roles.interrupt import Interrupted
    from elastic.roles.job_stop import JobStopped
    from elastic.roles.launch_errors import JobFailed
    from elastic.roles.launcher import launch_elastic

    plan = config.spec.plan
    run_dir = Path(args.run_dir)
    topo = Topology(nodes=max(plan.nodes) + 1)
    etcd: EtcdServer | None = None
    partitioner: Partitioner | None = None
    stopped = None

    def say(line: str) -> None:
        print(line, flush=True)

    try:
        topo.create()
        etcd = EtcdServer(host=topo.bridge_address, data_dir=run_dir / "etcd").start()
        (run_dir / "netns.json").write_text(json.dumps({
            "prefix": topo.prefix, "bridge": topo.bridge, "etcd": etcd.endpoint,
            "nodes": {m.node: {"namespace": m.namespace, "host_veth": m.host_veth, "address": m.address}
                      for m in topo.members},
        }, indent=1))
        say(f"netns: bridge {topo.bridge} {topo.bridge_address}, etcd {etcd.endpoint}, "
            + ", ".join(f"node {m.node} {m.namespace} {m.address}" for m in topo.members)
            + f"; partition by hand: deploy/netns/partition.sh --prefix {topo.prefix} NODE SECONDS")
        if args.check:
            for line in run_probe(topo, etcd.endpoint):
                say(f"netns: {line}")
        job = f"netns-{topo.prefix}"
        if partitions:
            partitioner = Partitioner(
                partitions, etcd=etcd.endpoint, job=job,
                set_fault=_fault_setter(topo, topo.bridge_address), say=say,
            ).start()

        def placement(node: int) -> tuple[list[str], dict[str, str]]:
            net = topo.node(node)
            return net.exec_prefix(), net.env()

        summary = launch_elastic(config, etcd_endpoint=etcd.endpoint, timeout_s=args.timeout, job=job,
                                 placement=placement, interrupt=interrupt)
    except Interrupted:
        raise KeyboardInterrupt from None  # every process of the job is stopped; the rest goes below
    except JobStopped as exc:  # `elastic drain --all`: at a step boundary, with a checkpoint there
        summary, stopped = exc.summary, exc.outcome
    except (JobFailed, TimeoutError, RuntimeError) as exc:
        print(f"deploy/netns/launch.py: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if partitioner is not None:
            partitioner.stop()
            (run_dir / "partitions.json").write_text(partitioner.to_json())
        if etcd is not None:
            etcd.stop()
        topo.destroy()
    if partitioner is not None and partitioner.error is not None:
        print(f"deploy/netns/launch.py: error: the partition failed: {partitioner.error}", file=sys.stderr)
        return 1
    say(f"netns: {summary.steps_committed} steps committed, final loss "
        f"{summary.losses[-1] if summary.losses else float('nan'):.4f}, {len(summary.recoveries)} recoveries"
        + ("" if stopped is None else f"; stopped on request after step {stopped.step}, checkpoint "
           f"{'complete' if stopped.complete else 'INCOMPLETE'} in {stopped.checkpoint_dir}"))
    if args.summary is not None:
        args.summary.write_text(summary.to_json())
    if args.final_state is not None:
        if stopped is not None and not stopped.complete:
            print("deploy/netns/launch.py: error: the stop's checkpoint is incomplete: no final state", file=sys.stderr)
            return 1
        import torch

        torch.save(_final_state(config, stopped), args.final_state)
    return 0 if stopped is None else 3


def _final_state(config: Any, stopped: Any) -> dict[str, Any]:
    """Canonical name -> fp32 tensor of the final parameters: what pipeline 0 wrote at the end, or
    the parameters of the stop's checkpoint."""
    if stopped is None:
        from elastic.records.summary import load_final_state

        return load_final_state(config.spec)
    from elastic.engine.checkpoint.params import checkpoint_params

    plan = config.spec.plan
    return checkpoint_params(Path(stopped.checkpoint_dir), stopped.step, config.spec.model_config,
                             tp_degree=plan.gpus_per_node)


if __name__ == "__main__":
    sys.exit(main())
