"""Baselines for the experiments, run in the same harness as gossip (experiments/harness.py).

- ``ddp``: torch DistributedDataParallel over gloo, one process per rank on 127.0.0.1.
- ``param_server``: one server holding the model; workers push gradients and
  pull parameters over ZeroMQ (msgpack headers + raw tensor bytes), synchronous
  or asynchronous.

Each worker trains the shard, batches, seed and optimizer settings of the
gossip peer with the same index, and the straggler is slowed the same way.
hivemind is not included (see the experiments' summaries).
"""
