"""Sans-IO protocol cores: state machines that take events and ``now`` and return actions.

Membership (SWIM), join answering and admission, the end of a run, the
averaging algorithms and the state-transfer fetcher and donor. Nothing here
touches a socket, a thread, an event loop or the clock, and nothing here
sends: the drivers in ``gossiptrain.runtime`` (real time) and
``gossiptrain.sim`` (virtual time) feed events in and carry actions out.
"""
