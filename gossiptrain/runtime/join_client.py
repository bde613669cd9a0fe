"""A newcomer's side of joining: send the request, wait for a welcome or a refusal, retry a few times.

The answer itself is decided by ``gossiptrain.protocol.joining.answer_join``
on whichever member we asked (the coordinator or any peer), and comes back
over our own connection to it (``send(replies=True)``): a newcomer nobody can
dial is answered too. Whether others can dial it is the ``reach`` probe's
business (``gossiptrain.protocol.reachability``); one that arrives before
the welcome is shown to the ``ReachCheck`` here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random

from gossiptrain.config import Limits
from gossiptrain.errors import JoinError, MismatchError, ProtocolError
from gossiptrain.net.addressing import connection_refused, plain_address
from gossiptrain.net.kinds import JOIN, LEAVE, REACH, REFUSE, REPORT, WELCOME
from gossiptrain.net.transport import Transport
from gossiptrain.net.wire import Message, decode, encode
from gossiptrain.protocol.joining import JoinRequest, Welcome
from gossiptrain.protocol.member import LEFT, Member
from gossiptrain.protocol.reachability import ReachCheck, Verdict, nonce_of
from gossiptrain.runtime.clock import Clock

log = logging.getLogger(__name__)

#: Seconds without an answer before we look whether anything listens at the target at all
#: (a live member answers in milliseconds; looking costs it a counted failed handshake).
PROBE_AFTER = 0.25
#: Seconds between attempts while the target refuses connections (a member still starting up).
REFUSED_PAUSE = 0.25
#: Seconds between looks at whether our dial-back probe has come, before its deadline is known.
REACH_POLL = 0.02


def plural_attempts(n: int) -> str:
    """The count with its noun ("1 attempt", "5 attempts"), for messages people read."""
    return f"{n} attempt" if n == 1 else f"{n} attempts"


async def join_swarm(
    transport: Transport,
    target: str,
    request: JoinRequest,
    *,
    advertise: str,
    limits: Limits,
    clock: Clock,
    attempts: int,
    attempt_timeout: float,
    rng: random.Random,
    reach: ReachCheck | None = None,
) -> Welcome:
    """Ask the member at ``target`` to admit us; retry a bounded number of times.

    A send that cannot be queued yet (the connection is still being set up)
    is retried every 50 ms within the attempt, so a reachable member answers
    in milliseconds rather than after a whole attempt timeout. Each attempt
    waits a little longer at random, so that newcomers refused together (a
    full queue at the answerer) do not all come back at the same instant.
    A failed handshake with ``target`` (a CURVE key refused, a wrong server
    key, one side secure and the other not) ends the join within a quarter
    second, with the cause named: retrying cannot fix a key.

    Where nothing listens at ``target`` (its connections are refused), an
    attempt ends after ``PROBE_AFTER`` seconds and the next one starts
    ``REFUSED_PAUSE`` later, so the join fails within about half a second
    per attempt, while a member that starts listening meanwhile (one still
    starting up) is joined. A target that accepts connections but answers
    slowly gets every attempt's full ``attempt_timeout``.
    """
    if request.token is None:  # one for all our attempts (JoinRequest.token)
        request = dataclasses.replace(request, token=rng.randrange(1, 1 << 63))
    frames = encode(Message(JOIN, sender="", addr=advertise, fingerprint="", body=request.to_body()), limits)
    refused_before = transport.stats.handshake_failures
    started = clock.now()
    probing = True  # until a look finds something listening at target (or cannot tell)
    refused = False  # whether the last attempt found nothing listening
    for attempt in range(1, attempts + 1):
        if refused:
            await clock.sleep(REFUSED_PAUSE)
        refused = False
        now = clock.now()
        deadline = now + attempt_timeout * rng.uniform(1.0, 1.5)
        probe_at = now + PROBE_AFTER
        sent = transport.send(target, frames, replies=True)
        while clock.now() < deadline:
            wait = 0.05 if not sent else min(0.25, deadline - clock.now())
            try:
                got = await asyncio.wait_for(transport.recv(), timeout=max(0.0, wait))
            except TimeoutError:
                failure = transport.connect_failure(target)
                if failure:
                    raise JoinError(f"cannot join: {failure}") from None
                if probing and clock.now() >= probe_at:
                    found = await connection_refused(target)
                    if found:
                        refused = True
                        transport.forget(target)  # no stale join queued for when it comes up: the next attempt sends anew
                        break
                    probing = False  # something listens (or we cannot tell): wait for its answer
                if not sent:
                    sent = transport.send(target, frames, replies=True)
                continue
            try:
                msg = decode(got, limits)
            except ProtocolError:
                continue
            if msg.kind == REACH and reach is not None:  # dialled back before the welcome came: keep the proof
                try:
                    reach.on_probe(nonce_of(msg.body))
                except ProtocolError:
                    pass
                continue
            if msg.kind == REFUSE:
                reason = msg.body.get("reason") if isinstance(msg.body, dict) else None
                raise MismatchError(f"{plain_address(target)} refused us: {str(reason)[:2000]}")
            if msg.kind == WELCOME:
                try:
                    return Welcome.from_body(msg.body, msg.addr, limits)
                except ProtocolError as e:
                    raise JoinError(f"{plain_address(target)} answered with an invalid welcome: {e}") from None
        if refused:
            log.info("nothing listens at %s yet: connection refused (attempt %d of %d)", plain_address(target), attempt, attempts)
        else:
            log.warning("no answer from %s yet (attempt %d of %d)", plain_address(target), attempt, attempts)
    if refused:
        raise JoinError(
            f"cannot join {plain_address(target)}: connection refused, nothing listens there "
            f"({plural_attempts(attempts)} over {clock.now() - started:.1f} s). Is a gossiptrain coordinator or peer running "
            "there, on that port? To wait longer for one still starting up, give more join attempts (--join-attempts)."
        )
    hint = ""
    if transport.stats.handshake_failures > refused_before:
        hint = (
            " Meanwhile we refused a connection: if it was the answer, the answerer's public key is not in our "
            "allow-list directory (--allow)."
        )
    raise JoinError(
        f"no answer from {plain_address(target)} after {plural_attempts(attempts)} of {attempt_timeout:g}+ s each. "
        "Is a gossiptrain coordinator or peer running there, on that port?" + hint
    )


async def reach_verdict(transport: Transport, check: ReachCheck, address: str, limits: Limits, clock: Clock) -> Verdict:
    """Whether others can dial us at ``address``: once our ``reach`` probe came, or its wait ran out.

    Read from ``transport`` itself, before this peer's node runs (its
    address depends on the answer: a peer nobody can dial joins again as a
    client). Anything else that arrives meanwhile is dropped: we are a
    placeholder in the answerer's view, which nobody probes or sends
    exchanges to. Bounded by the wait ``check.welcomed`` set
    (``membership.join_timeout``); a reachable newcomer's probe has usually
    arrived while its model was built, so this returns at once.
    """
    while True:
        # What has arrived first (a slow model build may outlast the wait), then the verdict.
        while len(transport.inbox) and not check.probed:
            _take_probe(check, await transport.recv(), limits)
        if (verdict := check.verdict(address, clock.now())) is not None:
            return verdict
        due = check.wake_at()  # the probe's deadline: wait for the next message until then, not in slices
        try:
            wait = REACH_POLL if due is None else max(0.0, due - clock.now())
            _take_probe(check, await asyncio.wait_for(transport.recv(), timeout=wait), limits)
        except TimeoutError:
            pass


def _take_probe(check: ReachCheck, frames: list[memoryview], limits: Limits) -> None:
    try:
        msg = decode(frames, limits)
        if msg.kind == REACH:
            check.on_probe(nonce_of(msg.body))
    except ProtocolError:
        pass


def not_joining(transport: Transport, welcome: Welcome, address: str) -> None:
    """Tell whoever welcomed us (at ``address``), and the coordinator, that we are not joining after all: nobody
    counts us. The answerer added us (as a placeholder, or to its registry) when it welcomed us; a model we could
    only compare afterwards (one built from the welcome's configuration) must not leave a member behind that never
    trains. A clean leave at our placeholder's incarnation outranks it. On the transport's thread."""
    me = Member(welcome.member_id, address, welcome.shard, incarnation=0, state=LEFT).to_wire()
    notices = [(welcome.coordinator, REPORT, {"member": me, "spec": None})] if welcome.coordinator else []
    if welcome.answered_by != welcome.coordinator:  # a peer answered: it holds us in its view
        notices.append((welcome.answered_by, LEAVE, {"members": [me]}))
    for addr, kind, body in notices:
        transport.send(addr, encode(Message(kind, welcome.member_id, address, welcome.fingerprint, 0, body),
                                    welcome.config.limits))
