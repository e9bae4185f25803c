"""Operating a running job: status, metrics and run reports (read-side, over etcd and run dirs)."""
