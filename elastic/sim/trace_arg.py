"""The `--trace` argument: which of the three trace forms a string names, and the trace it gives.

- `llama3[,...]`: Llama 3's failure rate and causes (elastic/sim/llama3_trace.py);
- a spec with `=` (`every=10m,min=15`, `slow_every=1h`, ...): a periodic trace (trace.py);
- anything else: a JSON file of events (trace.py).
"""

from __future__ import annotations

from elastic.sim.llama3_trace import is_llama3, llama3_trace
from elastic.sim.trace import Trace, load_trace, trace_from_spec


def trace_from_arg(text: str, *, initial_nodes: int, gpus_per_node: int, horizon_s: float) -> Trace:
    """The trace `text` names over [0, horizon_s] for `initial_nodes` nodes of `gpus_per_node`
    GPUs (only a llama3 trace's rate depends on the GPUs); TraceError for a bad one."""
    if is_llama3(text):
        return llama3_trace(text, initial_nodes=initial_nodes, gpus_per_node=gpus_per_node, horizon_s=horizon_s)
    if "=" in text:
        return trace_from_spec(text, initial_nodes=initial_nodes, horizon_s=horizon_s)
    return load_trace(text, initial_nodes=initial_nodes)
