"""The records every process role and the operator tools read: what goes into etcd and the run
directory (generation, progress, halt, recovery and injection records, the job spec, the run
summary) and the pure rules about them (partial replay). Imports only the layers below it
(model, data, coordinator, planning, templates), never the engine or the roles."""
