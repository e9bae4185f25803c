"""Sharded checkpoints of the training state: `writers.py` writes this worker's shards in the
background, `load.py` reads a step back, `files.py` is the on-disk layout and its commit
markers, `policy.py` says which worker writes which shard, `reshard.py` reads a step at another
tensor-parallel degree, `resume.py` picks the step a resumed run starts from and `params.py`
merges a step's full parameters (for export and sampling)."""
