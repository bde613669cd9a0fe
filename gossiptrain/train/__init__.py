"""What a peer trains and how: workloads, shards, evaluation, local steps, metrics, the CLI peer's loop."""
