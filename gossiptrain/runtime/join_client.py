"""A newcomer's side of joining: send the request, wait for a welcome or a refusal, retry a few times.

The answer itself is decided by ``gossiptrain.protocol.joining.answer_join``
on whichever member we asked (the coordinator or any peer).
"""

from __future__ import annotations

import asyncio
import logging
import random

from gossiptrain.config import Limits
from gossiptrain.errors import JoinError, MismatchError, ProtocolError
from gossiptrain.net.addressing import plain_address
from gossiptrain.net.kinds import JOIN, REFUSE, WELCOME
from gossiptrain.net.transport import Transport
from gossiptrain.net.wire import Message, decode, encode
from gossiptrain.protocol.joining import JoinRequest, Welcome
from gossiptrain.runtime.clock import Clock

log = logging.getLogger(__name__)


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
    """
    frames = encode(Message(JOIN, sender="", addr=advertise, fingerprint="", body=request.to_body()), limits)
    refused_before = transport.stats.handshake_failures
    for attempt in range(1, attempts + 1):
        deadline = clock.now() + attempt_timeout * rng.uniform(1.0, 1.5)
        sent = transport.send(target, frames)
        while clock.now() < deadline:
            wait = 0.05 if not sent else min(0.25, deadline - clock.now())
            try:
                got = await asyncio.wait_for(transport.recv(), timeout=max(0.0, wait))
            except TimeoutError:
                failure = transport.connect_failure(target)
                if failure:
                    raise JoinError(f"cannot join: {failure}") from None
                if not sent:
                    sent = transport.send(target, frames)
                continue
            try:
                msg = decode(got, limits)
            except ProtocolError:
                continue
            if msg.kind == REFUSE:
                reason = msg.body.get("reason") if isinstance(msg.body, dict) else None
                raise MismatchError(f"{plain_address(target)} refused us: {str(reason)[:2000]}")
            if msg.kind == WELCOME:
                try:
                    return Welcome.from_body(msg.body, msg.addr, limits)
                except ProtocolError as e:
                    raise JoinError(f"{plain_address(target)} answered with an invalid welcome: {e}") from None
        log.warning("no answer from %s yet (attempt %d of %d)", plain_address(target), attempt, attempts)
    hint = ""
    if transport.stats.handshake_failures > refused_before:
        hint = (
            " Meanwhile we refused a connection: if it was the answer, the answerer's public key is not in our "
            "allow-list directory (--allow)."
        )
    raise JoinError(
        f"no answer from {plain_address(target)} after {attempts} attempts of {attempt_timeout:g}+ s each. "
        f"Is a gossiptrain coordinator or peer running there, and can it reach this peer back at "
        f"{plain_address(advertise)}? (set --advertise to an address it can reach)" + hint
    )
