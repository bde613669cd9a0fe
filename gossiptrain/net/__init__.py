"""Bytes between peers: the wire codec, message kinds, addresses, keys and the transports.

The transports live behind one interface and a registry by URL scheme
(``gossiptrain.net.transport.listen``). Nothing here knows a protocol's
meaning: ``net`` never imports ``protocol``, ``state`` or ``runtime``.
"""
