"""Testing kits for code built on gossiptrain: what its own tests use, shipped for reuse.

- ``transport_checks``: the ``Transport`` conformance suite (``CHECKS``,
  ``check_transport``) and ``Backend`` descriptions for tcp:// and sim://, so
  that a new backend is held to the same contract.
- ``membership_cluster``: ``Cluster``, SWIM ``Membership`` machines on a
  virtual-time network with delay and loss, for protocol tests and experiments.
- ``averaging_nemesis``: ``Nemesis``, fault schedules (pauses, delays,
  drops, failed sends, full queues, deaths, clock jumps) against the real
  averaging machines, with mass conservation checked after every event;
  ``schedules()`` generates them with hypothesis.
- ``matchers``: ``match`` / ``only``, for assertions on the action lists that
  sans-IO state machines return.
- ``netns``: ``Namespace`` and ``Lan`` (namespaces on one bridge, IPv4 and
  optionally IPv6), Linux network namespaces as stand-in hosts with real
  addresses, ``LinkShape`` (tc netem delay, jitter, loss; a tbf rate) and
  ``NatRouter`` (hosts behind an iptables MASQUERADE router): the WAN
  harness (root only; not imported here).
- ``slurm``: ``slurm_cluster``, a one-node Slurm cluster (munged, slurmctld,
  slurmd) in a temporary directory, for tests of jobs under Slurm (root and
  Debian's slurm-wlm and munge only; not imported here).
- ``prometheus``: ``PrometheusServer``, a real Prometheus (Debian's
  ``prometheus`` binary) in a temporary directory scraping given
  ``--prometheus`` endpoints, with ``query`` and ``wait_scraped``; and
  ``dashboard_exprs`` / ``grafana_to_promql`` for a Grafana dashboard's
  queries (not imported here).

This is the top layer (beside ``gossiptrain.cli``): it may import any part of
the library, and the library never imports it.
"""

from gossiptrain.testing.matchers import match, only
from gossiptrain.testing.membership_cluster import Cluster, event_for
from gossiptrain.testing.transport_checks import CHECKS, Backend, check_transport, sim_backend, tcp_backend

__all__ = ["CHECKS", "Backend", "Cluster", "check_transport", "event_for", "match", "only", "sim_backend", "tcp_backend"]
