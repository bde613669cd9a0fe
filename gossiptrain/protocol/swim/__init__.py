"""The parts of the SWIM membership machine (``gossiptrain.protocol.membership.Membership``), one concern a module.

Split the way HashiCorp's memberlist splits its own: what goes in and out
of ``Membership.handle`` (``events``), the member table (``view``),
Lifeguard's local health and the probe timeouts (``timing``), the
piggybacked updates (``broadcasts``), the probe cycle (``probes``), the
precedence of what we hear (``merge``), suspicion timers (``suspicion``)
and the verification of candidates (``verification``). ``Membership`` owns
one of each and routes events between them.

Below them all, outside this package: the member record and its wire
checks (``gossiptrain.protocol.member``, which joining, the coordinator
and the end of a run use too) and the table of candidates
(``gossiptrain.protocol.candidates``). The modules here import one another
in one direction only (``view`` and ``timing`` first, ``merge`` and
``verification`` last), and this package's own module imports none of them.
"""
