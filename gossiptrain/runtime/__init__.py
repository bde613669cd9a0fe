"""Drivers in real time: services, the clock, endpoints, the peer's network side, the coordinator, ``Peer``.

This is the only layer that turns wire messages into protocol events and
protocol actions into messages, and that owns event loops and threads.
"""
