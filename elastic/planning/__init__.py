"""Planner glue: what the planner (`templates/`) needs from a cluster and a model (the cluster
spec, layer counts, the template set of a cluster) and the profiler that measures a model's
layers. Beside the planner, below everything that runs a job; the simulator uses it too."""
