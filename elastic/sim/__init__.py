"""`elastic simulate`: replay failure traces on clusters too large to run here, with the real planner.

A discrete-event model: each policy turns a trace of node failures, joins and slowdowns into
committed optimizer steps, with plan iteration times from the planner's cost model (slow nodes'
stages stretched by their factor), and recovery costs from `RecoveryCosts`. Every assumption is
stated in the policy docstrings and in the output.
"""

from elastic.sim.config import RecoveryCosts
from elastic.sim.planbook import PlanBook
from elastic.sim.result import PolicyResult, Segment
from elastic.sim.simulate import POLICIES, STRAGGLERS_OFF, references, run_policy, simulate
from elastic.sim.slowness import STRAGGLER_POLICIES
from elastic.sim.trace import Trace, TraceError, TraceEvent, load_trace, trace_from_json, trace_from_spec

__all__ = [
    "POLICIES",
    "PlanBook",
    "PolicyResult",
    "RecoveryCosts",
    "STRAGGLERS_OFF",
    "STRAGGLER_POLICIES",
    "Segment",
    "Trace",
    "TraceError",
    "TraceEvent",
    "load_trace",
    "references",
    "run_policy",
    "simulate",
    "trace_from_json",
    "trace_from_spec",
]
