"""The step engine of one worker process: the trainer (start a generation in place, prepare,
commit or discard a step), the step transaction, the optimizer, checkpoints and the device.
Talks to other workers through process groups and shard transfers, never to etcd; the roles
(`elastic.roles`) drive it."""
