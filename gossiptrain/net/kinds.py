"""Every message kind on the wire, defined once.

A kind names what a message means; ``gossiptrain.net.wire`` accepts only
these, and each protocol imports the kinds it speaks from here. Grouped by
the protocol that owns them, so a dispatch table can route a whole group.
"""

from __future__ import annotations

# Joining (gossiptrain.protocol.joining): a newcomer asks the coordinator or any member.
JOIN, WELCOME, REFUSE = "join", "welcome", "refuse"
# The member answering a join dials the newcomer back at its advertised address (gossiptrain.protocol.reachability).
REACH = "reach"
# A member's periodic report to the coordinator (gossiptrain.runtime.coordinator).
REPORT = "report"
# SWIM membership (gossiptrain.protocol.membership).
GOSSIP, SYNC, LEAVE, PING, PING_REQ, ACK = "gossip", "sync", "leave", "ping", "ping-req", "ack"
# Averaging (gossiptrain.protocol.pairwise and the other algorithms).
XREQ, XREP, XNAK = "xreq", "xrep", "xnak"
XPUSH = "xpush"  # one-way: parameters (push-sum mass, a neighbour's model) that need no reply
XACK = "xack"  # a push's receipt, no tensors: the pusher's link is free again (gossiptrain.protocol.receipts)
# Rank-matched piece exchanges of peers whose model is split across their ranks (gossiptrain.protocol.piece_exchange):
# a rank's piece asking, answering, refused; and leader to leader, the exchange's outcome for every rank, and the
# hello that swaps layouts and ranks' addresses before the first exchange (or refuses another layout).
XPREQ, XPREP, XPNAK, XPEND = "xpreq", "xprep", "xpnak", "xpend"
XPHELLO, XPWELCOME = "xphello", "xpwelcome"
# State transfer to newcomers (gossiptrain.protocol.state_transfer; a split peer's ranks speak it rank by rank).
SREQ, SREP, SNAK, SACK = "sreq", "srep", "snak", "sack"
# A rendezvous: the members ready to train (gossiptrain.protocol.rendezvous).
READY = "ready"
# Leased chunks of a shared dataset: a member's lease table (gossiptrain.protocol.leases).
LEASE = "lease"
# The end of a run, and tools outside the swarm (gossiptrain.protocol.finish).
QUERY, ROSTER, STOP, FIN = "query", "roster", "stop", "fin"
# A visitor asks one member how it is doing (gossiptrain.protocol.status): `gossiptrain status`, the dashboard.
STATUS_ASK, STATUS = "status-ask", "status"

JOINING = (JOIN, WELCOME, REFUSE, REACH)
MEMBERSHIP = (GOSSIP, SYNC, LEAVE, PING, PING_REQ, ACK)
EXCHANGE = (XREQ, XREP, XNAK, XPUSH, XACK)
PIECES = (XPREQ, XPREP, XPNAK, XPEND, XPHELLO, XPWELCOME)
STATE = (SREQ, SREP, SNAK, SACK)
RENDEZVOUS = (READY,)
LEASES = (LEASE,)
FINISH = (QUERY, ROSTER, STOP, FIN)
STATUS_KINDS = (STATUS_ASK, STATUS)

ALL: frozenset[str] = frozenset(JOINING + (REPORT,) + MEMBERSHIP + EXCHANGE + PIECES + STATE + RENDEZVOUS + LEASES + FINISH + STATUS_KINDS)
