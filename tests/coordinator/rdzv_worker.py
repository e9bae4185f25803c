"""A torchrun worker for the rendezvous tests: report who I am, then idle until killed.

Writes <out_dir>/<ELASTIC_NODE_ID>-<LOCAL_RANK>.json with its pid and the rendezvous
environment, then sleeps (at most `lifetime` seconds, so nothing outlives a broken test).
"""

import json
import os
import sys
import time

out_dir, lifetime = sys.argv[1], float(sys.argv[2])
names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "ELASTIC_JOB", "ELASTIC_NODE_ID",
         "ELASTIC_INCARNATION", "ELASTIC_RDZV_ROUND", "ELASTIC_ETCD_ENDPOINT", "ELASTIC_ETCD_USER", "ELASTIC_ETCD_CA",
         "ELASTIC_ETCD_CERT", "ELASTIC_ETCD_KEY"]
record = {"pid": os.getpid(), **{n: os.environ.get(n) for n in names}}
path = os.path.join(out_dir, f"{os.environ['ELASTIC_NODE_ID']}-{os.environ['LOCAL_RANK']}.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
time.sleep(lifetime)
