"""The processes of a job, each on its side of the etcd line; a file's name says whose side it is on.

- launcher (`elastic run`): launcher.py (elastic runs), agent_pool.py, run_loop.py,
  launcher_feed.py (what it reads of the run), job_stop.py, launch_errors.py; static_launcher.py
  for a fixed plan, whose workers are static_worker.py;
- node agent: agent.py, agent_injections.py, agent_preemption.py, the leader it may hold
  (leader.py), and what it serves its workers (node_relay.py, node_feed.py);
- elastic worker: elastic_worker.py (the loop), worker_feeds.py (what it watches and writes in
  etcd), worker_generations.py, worker_checkpoints.py, step_records.py, shard_sources.py,
  holders.py, abortable_store.py, worker_log.py;
- the warm parent they are forked from: zygote.py (its side), zygote_client.py (the requester's).

The top of the runtime: roles import the engine, the records, the coordinator and the operator
modules, and nothing imports a role except the CLI."""
