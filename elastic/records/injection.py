"""Fault injections of `elastic run --inject`: the values, their parsing and their checks against
the run.

`elastic run --inject` values (carried out like the operator's `elastic inject`, see below):

    kill:node=2,step=8        SIGKILL node 2's workers while step 8 (as printed, 1..K) is in flight
    kill:node=2,step=8,at=0.5 ... half-way through step 8: `at` x the duration of step 7 after
                              step 8 came in flight (0: at once; the same for hang)
    hang:node=2,step=8        SIGSTOP node 2's workers, then its agent (its lease expires)
    kill:node=3,when=reconfig SIGKILL node 3's workers as soon as the first reconfiguration begins
    rejoin:node=2,step=15     start a fresh agent (next incarnation) for the failed node 2

A step is "in flight" from the moment the previous step's commit is decided.

Each value becomes an `InjectionRequest` (injection_requests.py) under the job's `injections/<id>`
key when the job starts, like the operator's `elastic inject`; a slowed node's throttle is
throttle.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from elastic.coordinator.jsonrecord import JsonRecord

Kind = Literal["kill", "hang", "rejoin"]
When = Literal["step", "reconfig"]
_KINDS: tuple[Kind, ...] = ("kill", "hang", "rejoin")


@dataclass(frozen=True, kw_only=True)
class Injection(JsonRecord):
    """One fault to inject (a part of the job's config, never a record of its own in etcd)."""

    kind: Kind
    """kill (SIGKILL the workers), hang (SIGSTOP workers and agent) or rejoin (fresh agent)."""
    node: int
    """Plan node it targets."""
    step: int | None = None
    """Step (1-based, as printed) during which it fires; None with when="reconfig"."""
    when: When = "step"
    """"step": while `step` is in flight; "reconfig": when the first reconfiguration begins."""
    at: float | None = None
    """With a step: fire this fraction of the previous step's duration after `step` came in
    flight (None or 0: at once)."""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown injection kind {self.kind!r}; use one of {', '.join(_KINDS)}")
        if self.node < 0:
            raise ValueError(f"injection node must be >= 0, got {self.node}")
        if self.when == "step":
            if self.step is None or self.step < 1:
                raise ValueError(f"{self.kind}: step must be given and >= 1 (steps are numbered from 1)")
        elif self.when == "reconfig":
            if self.kind == "rejoin":
                raise ValueError("rejoin cannot use when=reconfig; give step=N")
            if self.step is not None:
                raise ValueError("give either step=N or when=reconfig, not both")
        else:
            raise ValueError(f"injection when must be 'step' or 'reconfig', got {self.when!r}")
        if self.at is not None and (self.when != "step" or self.kind == "rejoin" or not 0.0 <= self.at <= 10.0):
            raise ValueError(f"{self.kind}: at must be a fraction in [0, 10] of a step, with step=N (got {self.at})")

    @property
    def name(self) -> str:
        """A stable key-safe name, e.g. `kill-node2-step8` (`kill-node2-step8-at0.5` with `at`)."""
        at = f"step{self.step}" if self.when == "step" else "reconfig"
        return f"{self.kind}-node{self.node}-{at}" + (f"-at{self.at:g}" if self.at else "")


def parse_injection(text: str) -> Injection:
    """Parse one `--inject` value (see the module doc); ValueError with the reason otherwise."""
    kind, sep, rest = text.partition(":")
    if not sep or kind not in _KINDS:
        raise ValueError(
            f"--inject {text!r}: expected KIND:key=value,... with KIND one of {', '.join(_KINDS)}"
        )
    fields: dict[str, str] = {}
    for part in rest.split(","):
        key, eq, value = part.partition("=")
        if not eq or not key or not value:
            raise ValueError(f"--inject {text!r}: {part!r} is not key=value")
        if key in fields:
            raise ValueError(f"--inject {text!r}: {key} given twice")
        fields[key] = value
    unknown = set(fields) - {"node", "step", "when", "at"}
    if unknown:
        raise ValueError(
            f"--inject {text!r}: unknown key(s) {', '.join(sorted(unknown))} (use node, step, when, at)"
        )
    if "node" not in fields:
        raise ValueError(f"--inject {text!r}: node=N is required")
    try:
        node = int(fields["node"])
        step = int(fields["step"]) if "step" in fields else None
    except ValueError:
        raise ValueError(f"--inject {text!r}: node and step must be integers") from None
    try:
        at = float(fields["at"]) if "at" in fields else None
    except ValueError:
        raise ValueError(f"--inject {text!r}: at must be a number (a fraction of a step)") from None
    when = fields.get("when", "step")
    if when not in ("step", "reconfig"):
        raise ValueError(f"--inject {text!r}: when must be 'reconfig' (or omitted), got {when!r}")
    try:
        return Injection(kind=kind, node=node, step=step, when=when, at=at)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"--inject {text!r}: {exc}") from None


def check_injections(injections: list[Injection], *, nodes: int, steps: int) -> None:
    """ValueError if an injection names a node outside the run or a step past its end."""
    for inj in injections:
        if inj.node >= nodes:
            raise ValueError(f"--inject {inj.name}: node {inj.node} is not in the run (nodes 0..{nodes - 1})")
        if inj.step is not None and inj.step > steps:
            raise ValueError(f"--inject {inj.name}: step {inj.step} is past the last step {steps}")
    rejoined = {i.node for i in injections if i.kind == "rejoin"}
    failed = {i.node for i in injections if i.kind != "rejoin"}
    if rejoined - failed:
        raise ValueError(
            f"--inject rejoin of node(s) {sorted(rejoined - failed)} that no injection fails first"
        )
