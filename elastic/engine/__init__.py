"""The step engine of one worker process: the trainer (trainer.py: switch to a generation in
place, prepare, commit or discard a step), the generation builder (generation.py), the shards
the worker holds (shard_store.py), the step transaction (step.py), the optimizer, the static
reference loop (static_loop.py), checkpoints (checkpoint/) and the device. Talks to other
workers through process groups and shard transfers, never to etcd; the roles (`elastic.roles`)
drive it."""
