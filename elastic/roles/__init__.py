"""The processes of a job, each on its side of the etcd line: the launcher (`elastic run`), the
node agent, the leader it may hold, the elastic worker loop, the worker's etcd feeds and the
launcher's progress feed. The top of the runtime: roles import the engine, the records, the
coordinator and the operator modules, and nothing imports a role except the CLI."""
