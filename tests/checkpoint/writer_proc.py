"""A real writer process: `python -m tests.checkpoint.writer_proc SPEC_JSON`.

SPEC_JSON: {"dir", "num_layers", "tp", "saves": [{"step", "keys": [[l, t], ...], "numel"}]}.
Each save is written and flushed in turn; after each the process prints `saved <step>` (flushed),
so a parent can time a SIGKILL against the next save.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from elastic.engine.checkpoint.writers import CheckpointWriter
from tests.checkpoint.shards import make_shards


def main(spec: dict) -> None:
    writer = CheckpointWriter(Path(spec["dir"]), num_layers=spec["num_layers"], tp_degree=spec["tp"])
    for save in spec["saves"]:
        keys = [(int(k[0]), int(k[1])) for k in save["keys"]]
        writer.save_async(save["step"], make_shards(keys, step=save["step"], numel=save["numel"]))
        writer.flush()
        print(f"saved {save['step']}", flush=True)
    writer.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
