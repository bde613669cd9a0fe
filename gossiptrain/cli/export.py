"""`gossiptrain export` and `gossiptrain stop`: tools that talk to a running swarm without joining it.

``export`` writes the merged model (every live member's state averaged,
weighted by samples seen; see ``gossiptrain.state.merged_model`` and
``gossiptrain.runtime.swarm_client``) of a running swarm; with
``--checkpoint DIR`` instead, the model of a peer whose model is split
across its ranks, its pieces put back together from the checkpoints each
rank wrote (``gossiptrain.runtime.piece_checkpoints``). ``stop`` asks the
swarm to finish: every peer runs its final phase and exits (see
``gossiptrain.protocol.finish``). Either takes ``--join`` as a peer does: the
coordinator or any live peer.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any, Callable

from gossiptrain.cli.common import EXIT_FAILED, check_join, check_output_path, setup_logging
from gossiptrain.errors import GossipError
from gossiptrain.runtime.loop_thread import new_event_loop


def add_parsers(
    sub: Any, add_security: Callable[[argparse.ArgumentParser, bool], None], security: Callable[[argparse.Namespace], Any]
) -> None:
    """Add the two subcommands; the security flags and their parsing are the CLI's own (``cli._add_security_flags``)."""
    p = sub.add_parser(
        "export", help="write the merged model of a running swarm (live members' states averaged, weighted by samples seen)"
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--join", metavar="HOST:PORT", help="the coordinator or any live peer (this, or --checkpoint)")
    source.add_argument("--checkpoint", metavar="DIR",
                        help="instead: a split peer's checkpoint directory (rank-<r>/ for each rank): its pieces gathered")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="the safetensors file to write (metadata goes to FILE.json); a path or a URL (s3://, gs://, ...)")
    p.add_argument("--advertise", metavar="HOST", help="host the members reach us at (default: our address on the route to --join)")
    p.add_argument("--members-dir", metavar="DIR", help="also keep each member's state there (<id>.safetensors)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS", help="per member, before it is skipped (default 60)")
    p.add_argument("--max-bytes", type=int, default=64 << 30, metavar="N", help="refuse a member's state over this size (default 64 GiB)")
    add_security(p, True)
    p.set_defaults(func=lambda args: cmd_export(args, security(args)))

    p = sub.add_parser("stop", help="ask a running swarm to finish: final consensus, merged model (peers' --final-model), exit")
    p.add_argument("--join", required=True, metavar="HOST:PORT", help="the coordinator or any live peer")
    p.add_argument("--advertise", metavar="HOST", help="host the answer reaches us at (default: our address on the route to --join)")
    p.add_argument("--reason", default="gossiptrain stop", help="said in every peer's log")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="then wait until the contacted member knows no live member (default 0: do not wait)")
    add_security(p, True)
    p.set_defaults(func=lambda args: cmd_stop(args, security(args)))


def _export_checkpoint(args: argparse.Namespace) -> int:
    """The unsplit model of a split peer's checkpoints, written as a merged model of that one peer."""
    from gossiptrain.runtime.piece_checkpoints import gather
    from gossiptrain.state import storage
    from gossiptrain.state.merged_model import MemberInfo, write_merged

    setup_logging(args.verbose)
    storage.check_location(args.out, "--out")
    check_output_path(args.out, "--out")
    tensors, ckpt = gather(args.checkpoint)
    info = ckpt.info
    written = write_merged(args.out, tensors, members=[MemberInfo(info.peer, info.samples_seen, info.step)],
                           fingerprint=info.fingerprint, run=info.run, written_by="gossiptrain export --checkpoint")
    _say(f"wrote {written.path} ({written.bytes / 1e6:.1f} MB, sha256 {written.sha256[:16]}) and {written.metadata}: "
         f"{len(tensors)} tensors of step {info.step}, gathered from the pieces in {args.checkpoint}")
    return 0


def _say(line: str) -> None:
    print(line, flush=True)


def cmd_export(args: argparse.Namespace, security: Any) -> int:
    if args.checkpoint is not None:
        return _export_checkpoint(args)
    check_join(args.join)  # before anything heavy is imported
    from gossiptrain.runtime.swarm_client import export
    from gossiptrain.state import storage
    from gossiptrain.state.merged_model import NothingToMerge

    setup_logging(args.verbose)
    if not args.timeout > 0 or args.max_bytes < 1:
        raise GossipError("--timeout must be > 0 seconds and --max-bytes >= 1")
    storage.check_location(args.out, "--out")  # a URL fsspec cannot serve fails before any download
    storage.check_location(args.members_dir, "--members-dir")
    check_output_path(args.out, "--out")  # a folder given as the file fails now, not after every member's download
    if args.members_dir is not None:
        check_output_path(args.members_dir, "--members-dir", directory=True)
    try:
        report = _run(export(
            args.join, args.out, security=security, advertise=args.advertise, members_dir=args.members_dir,
            seconds_per_member=args.timeout, max_bytes=args.max_bytes, progress=_say,
        ))
    except NothingToMerge as e:  # the swarm was reached, but there was nothing to merge: a failure, not a usage error
        print(f"gossiptrain export: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    info = report.info
    skipped = f"; skipped {', '.join(f'{m} ({why})' for m, why in report.skipped)}" if report.skipped else ""
    _say(
        f"wrote {info.path} ({info.bytes / 1e6:.1f} MB, sha256 {info.sha256[:16]}) and {info.metadata}: "
        f"{len(report.members)} members, {sum(m.samples for m in report.members)} samples, "
        f"{report.bytes / 1e6:.1f} MB downloaded in {report.seconds:.1f} s{skipped}"
    )
    return 0


def cmd_stop(args: argparse.Namespace, security: Any) -> int:
    check_join(args.join)  # before anything heavy is imported
    from gossiptrain.runtime.swarm_client import SwarmClient

    setup_logging(args.verbose)

    async def main() -> int:
        async with SwarmClient(args.join, advertise=args.advertise, security=security) as client:
            roster = await client.query()
            if not roster.members:
                _say(f"no live member: nothing to stop ({roster.answered_by} knows none, run {roster.fingerprint})")
                return 0
            ack = await client.stop(args.reason)
            _say(
                f"stop requested: {ack.answered_by} passes it on to the {len(ack.members)} live members it knows "
                f"(run {roster.fingerprint}); each runs its final phase and exits"
            )
            if args.wait <= 0:
                return 0
            deadline = time.monotonic() + args.wait
            now = ack
            while time.monotonic() < deadline:
                try:
                    now = await client.query(attempts=1, timeout=1.0)
                except GossipError:
                    _say("the contacted member is gone: the swarm has finished")
                    return 0
                if not now.members:
                    _say("no live member left: the swarm has finished")
                    return 0
                await asyncio.sleep(0.5)
            _say(f"still {len(now.members)} live members after --wait {args.wait:g} s")
            return EXIT_FAILED

    return _run(main())


def _run(coro: Any) -> Any:
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)
