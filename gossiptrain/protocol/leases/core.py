"""One member's side of the chunk leases: claim what it can train soon, train it, mark it done, gossip the table.

A sans-IO machine like the rendezvous: its driver (the peer's network side,
or the simulator) calls ``tick`` by ``next_timer`` and ``handle`` with what
members send, and sends what they return; the training side asks
``next_chunk`` for work and reports ``trained`` samples. ``live()``, passed
in, is the membership's live view (ids, ourselves included).

**What a member claims.** Enough chunks for the next ``ahead`` seconds at its
own measured pace (samples per second, smoothed), at least one and at most
``max_held``: a fast member holds more, a slow one fewer, a newcomer one at
once. It takes first, lowest first, the free chunks of the window (not done,
and unclaimed or claimed by a member that is dead or has not renewed for
``lease_time``) it is first in line for: the line is rendezvous hashing
over the live members that still renew, weighted by the paces they publish
(``assignment``), so members that see the same view never claim the same
chunk, and each is first for a share of chunks in proportion to its pace:
the swarm's floor moves at the swarm's pace, not its slowest member's. A
member that stalls drops out of the line, and its chunks, claimed or not,
go to whoever is next. With none of its own left (its pace grew faster than
its bucket says, or the window is full), it steals: see ``_top_up``.

**When two claim one chunk** (views that differ for a moment, a takeover that
crossed a renewal), the table's rule picks the same winner on every member,
and the loser drops the chunk as soon as it hears: what it had trained of it
is counted (``samples_trained_twice``), bounded by a gossip round's worth of
its pace.

**Gossip.** Every ``interval`` a member sends its table to one live member
picked at random, which merges it and answers with its own: push-pull
anti-entropy, as membership's sync. A claim reaches every member in about
log2(n) intervals, which is what ``lease_time`` must exceed by far.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from gossiptrain.protocol.leases.assignment import Assignment, pace_bucket
from gossiptrain.protocol.leases.chunks import ChunkPlan
from gossiptrain.protocol.leases.table import Claim, LeaseTable

#: Chunks a window holds at least: on a small dataset an epoch is a fraction of a second of a fast swarm's
#: work, less than gossip takes to cross it, and members that have not heard the floor move run out of window.
#: Simulated, digits-small (44 chunks of 32 samples an epoch), 4 peers of 2 ms steps, one 4x slower: with 1,024
#: (0.6 s of the swarm's work) the peers waited for chunks in 4,400 of 17,000 steps; with 4,096 in none.
MIN_WINDOW = 4096
#: Free chunks of its own a member is left by thieves at least (see ``Leases._top_up``).
RESERVE = 2
#: Places in line that wait their turn to steal; further back, all wait as long as the last.
MAX_TURNS = 4
#: Seconds of the swarm's work a window should hold at least: a table crosses n members in about log2(n) gossip
#: intervals, and members that have not heard the floor rise claim nothing above their window. Simulated, 64 peers
#: of digits-small (1,437 samples, 44 chunks an epoch): the window held 0.26 s of the swarm's work, and the peers
#: waited for a chunk at half their steps.
WINDOW_MIN_SECONDS = 2.0
#: Weight of a new measurement in the smoothed pace, and the seconds each measurement spans at least.
PACE_SMOOTHING = 0.3
PACE_SPAN = 0.25
#: Share of the chunks it wants that a member trains before it claims again (at least one chunk).
TOP_UP_SHARE = 0.25
#: Seconds between the floor's samples for ``window_seconds``.
FLOOR_EVERY = 0.5


@dataclass(frozen=True)
class SendLeases:
    """Send our table (``body``) to member ``to``; ``reply``: it answers a table that member sent."""

    to: str
    body: dict[str, Any]
    reply: bool = False


@dataclass
class LeaseStats:
    """What a member's leases did, for ``Peer.stats()``, metrics and ``gossiptrain status``."""

    chunks_claimed: int = 0
    chunks_done: int = 0  # by us
    chunks_stolen: int = 0  # claimed though another member was preferred for them
    chunks_taken_over: int = 0  # claimed from a dead or silent holder
    claims_lost: int = 0  # our claims another member won
    samples_trained: int = 0
    samples_trained_twice: int = 0  # trained by us of chunks we then lost, or that someone else finished
    lease_waits: int = 0  # next_chunk found nothing to claim (the window is full of others' claims)
    chunks_resumed: int = 0  # a checkpoint's claims taken back after --resume

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Held:
    g: int
    trained: int = 0  # samples of it trained so far


@dataclass(frozen=True)
class LeaseSettings:
    """How a member leases."""

    interval: float = 0.2  # seconds between pushes of our table
    lease_time: float = 10.0  # a holder silent this long loses its claims
    ahead: float = 2.0  # seconds of our pace to hold claims for
    max_held: int = 16
    window_epochs: int = 2  # claims reach this many epochs' chunks above the floor
    renew_share: float = 0.25  # a training holder bumps its counter at most every this share of lease_time
    steal_after: float = 0.6  # seconds a chunk is in our window before we may steal it (3 gossip intervals)


class Leases:
    """One member's lease machine. See the module docstring."""

    def __init__(
        self, me: str, plan: ChunkPlan, *, live: Callable[[], Sequence[str]], rng: random.Random,
        settings: LeaseSettings | None = None,
    ) -> None:
        self.me = me
        self.plan = plan
        self.settings = s = settings or LeaseSettings()
        self.live = live
        self.rng = rng
        self.table = LeaseTable(max(plan.chunks * s.window_epochs, MIN_WINDOW))
        self.stats = LeaseStats()
        self.held: list[_Held] = []  # our claims, in the order we train them
        self.pace: float | None = None  # samples per second, smoothed
        self._beat = 0
        self._last_beat = -math.inf
        # The pace bucket our latest counter carries, since when, and the one our own line uses for us: the new
        # one only once the others have likely heard it (each member computing the line with its own fresh pace
        # and the others' old ones thought itself first for every chunk).
        self._published: int | None = None
        self._in_line: int | None = None  # None: we count as the median of the others (the line's rule for unknowns)
        self._published_at = -math.inf
        self._beat_seen: dict[str, tuple[int, float]] = {}  # owner -> (its counter, when we saw it change)
        self._next_push = 0.0
        self._pace_from: float | None = None  # when the span the pace is measured over began
        self._pace_samples = 0  # samples trained in it
        self._tops: deque[tuple[int, float]] = deque()  # (the window's top, when it rose to it), oldest first
        self._line = Assignment()  # who is first in line for each chunk
        self._floor_seen: tuple[int, float] = (-1, 0.0)  # the floor, and since when we have seen it there
        self._own_from = 0  # where the next scan for chunks of ours starts (see _top_up)
        self._floors: deque[tuple[float, int]] = deque(maxlen=8)  # (when, the floor then), every FLOOR_EVERY s
        self._resume: list[tuple[int, int]] | None = None  # a checkpoint's claims, until we take them back
        self._was = ""  # the member id that held them
        self._heard = False  # we have merged another member's table
        self.table.beat(me, 0)

    # -- what the trainer calls -------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the swarm is in: that of the lowest chunk not done."""
        return self.plan.epoch_of(self.table.floor)

    def epoch_progress(self) -> tuple[int, int]:
        """(chunks done of the current epoch, chunks per epoch)."""
        start = self.epoch * self.plan.chunks
        ahead = sum(1 for g in self.table.done if g < start + self.plan.chunks)
        return self.table.floor - start + ahead, self.plan.chunks

    def window_seconds(self, now: float) -> float | None:
        """Seconds of the swarm's work the window holds, at the rate its floor rose lately (None: not known yet).
        Under WINDOW_MIN_SECONDS, members wait for chunks: the swarm runs through the window faster than its
        tables spread (too many small chunks for so fast a swarm)."""
        if not self._floors or now - self._floors[-1][0] >= FLOOR_EVERY:
            self._floors.append((now, self.table.floor))
        (t0, f0), (t1, f1) = self._floors[0], self._floors[-1]
        if t1 - t0 < 2 * FLOOR_EVERY or f1 <= f0:
            return None
        return self.table.window / ((f1 - f0) / (t1 - t0))

    def next_chunk(self, now: float) -> tuple[int, int] | None:
        """(chunk, samples of it already trained) to train next, claiming more if we hold too few; None: wait."""
        held = self.holding(now)
        return held[0] if held else None

    def resume(self, held: Sequence[tuple[int, int]], was: str = "") -> None:
        """A checkpoint's claims (chunk, samples trained by it) of member ``was`` (our earlier incarnation): taken
        back once we have heard the swarm's table (before that we cannot tell which were finished or taken over
        meanwhile), trained on from where they were."""
        self._resume = [(g, t) for g, t in held if 0 <= t < self.plan.size(g)]
        self._was = was

    def holding(self, now: float, samples: int = 0) -> list[tuple[int, int]]:
        """Every chunk we hold, in the order to train them, with the samples of each trained already (claiming
        more if we hold too few, or fewer than ``samples`` untrained: a batch's worth); empty: wait."""
        if self._resume is not None and (self._heard or not [m for m in self.live() if m != self.me]):
            self._take_back(now)
        # (Claims are lost only in a merge, which drops them: ``handle``.)
        self._top_up(now, samples)
        if not self.held:
            self.stats.lease_waits += 1
        return [(h.g, h.trained) for h in self.held]

    def trained(self, g: int, samples: int, now: float) -> None:
        """``samples`` more of chunk ``g`` were trained: the chunk is done when all were."""
        if samples <= 0:
            return
        self.stats.samples_trained += samples
        # The pace over spans of PACE_SPAN at least: a loop that reports each sample as a DataLoader takes it
        # reports bursts of a batch, then a step's pause.
        if self._pace_from is None:
            self._pace_from, self._pace_samples = now, 0
        else:
            self._pace_samples += samples
            if now - self._pace_from >= PACE_SPAN:
                rate = self._pace_samples / (now - self._pace_from)
                self.pace = rate if self.pace is None else self.pace + PACE_SMOOTHING * (rate - self.pace)
                self._pace_from, self._pace_samples = now, 0
        h = next((h for h in self.held if h.g == g), None)
        if h is None:  # lost meanwhile: whoever won trains it
            self.stats.samples_trained_twice += samples
            return
        h.trained += samples
        if h.trained >= self.plan.size(g):
            self.held.remove(h)
            if self.table.is_done(g):
                self.stats.samples_trained_twice += h.trained
            else:
                self.table.mark_done(g)
                self.stats.chunks_done += 1
        if (now - self._last_beat >= self.settings.renew_share * self.settings.lease_time
                or self._bucket() != self._published):  # a new pace changes the line: say so at once
            self._renew(now)

    # -- what the driver calls --------------------------------------------------------------------

    def next_timer(self) -> float:
        return self._next_push

    def tick(self, now: float) -> list[SendLeases]:
        """Push our table to a random live member every ``interval``."""
        if now < self._next_push:
            return []
        self._next_push = now + self.settings.interval * self.rng.uniform(0.9, 1.1)
        others = [m for m in self.live() if m != self.me]
        if not others:
            return []
        return [SendLeases(self.rng.choice(others), self._body())]

    def handle(self, sender: str, body: dict[str, Any], now: float, *, reply: bool) -> list[SendLeases]:
        """A member's table: merge it, drop what we lost, and answer a push with ours."""
        other = LeaseTable.from_wire(body, self.table.window)
        for owner, count in other.beats.items():
            seen = self._beat_seen.get(owner)
            if seen is None or count > seen[0]:
                self._beat_seen[owner] = (count, now)
        self.table.merge(other)
        self._own_from = 0  # claims may have lapsed or moved: scan from the floor again
        self._heard = True
        self._drop_lost()
        return [] if reply else [SendLeases(sender, self._body(), reply=True)]

    # -- inside -----------------------------------------------------------------------------------

    def _body(self) -> dict[str, Any]:
        self.table.prune_beats([self.me])
        return self.table.to_wire()

    def _renew(self, now: float) -> None:
        self._beat += 1
        self._last_beat = now
        bucket = self._bucket()
        if bucket != self._published:
            self._published, self._published_at = bucket, now
        self.table.beat(self.me, self._beat, self._published)

    def _bucket(self) -> int:
        """The pace bucket to publish: a new one only when the pace is a bucket and a half away from the one
        published (a pace near a bucket's edge would flip the line back and forth)."""
        if self.pace is None:
            return self._published
        exact = 2 * math.log2(max(self.pace, 1.0))
        if self._published is None or abs(exact - self._published) >= 1.5:
            return pace_bucket(self.pace)
        return self._published

    def _wanted(self) -> int:
        """Chunks to hold: ``ahead`` seconds of our pace, 1..max_held."""
        if not self.pace:
            return 1
        mean = self.plan.samples / self.plan.chunks
        return max(1, min(self.settings.max_held, math.ceil(self.pace * self.settings.ahead / mean)))

    def _free(self, g: int, now: float, live: set[str]) -> tuple[bool, Claim | None]:
        """Whether chunk ``g`` may be claimed, and the claim it would take over (None: unclaimed)."""
        if self.table.is_done(g):
            return False, None
        c = self.table.claim_of(g)
        if c is None:
            return True, None
        if c.owner == self.me:
            return False, None
        return self._expired(c.owner, now, live), c

    def _expired(self, owner: str, now: float, live: set[str]) -> bool:
        if owner not in live:
            return True
        seen = self._beat_seen.get(owner)
        if seen is None:  # never heard it renew: from the first time we saw its claim
            self._beat_seen[owner] = (self.table.beats.get(owner, -1), now)
            return False
        return now - seen[1] > self.settings.lease_time

    def _top_up(self, now: float, samples: int = 0) -> None:
        wanted = self._wanted()
        need = wanted - len(self.held)
        short = samples - sum(self.plan.size(h.g) - h.trained for h in self.held) if samples > 0 else 0
        if short > 0:  # a batch's worth first
            need = max(need, min(self.settings.max_held - len(self.held), math.ceil(short * self.plan.chunks / self.plan.samples)))
        # Claims in a handful: a member that holds most of what it wants scans again only when a TOP_UP_SHARE
        # of it is trained (a claim per chunk trained cost a scan per chunk, a batch or two of a small model).
        elif self.held and need < math.ceil(wanted * TOP_UP_SHARE):
            return
        if need <= 0:
            return
        # In line: the live members that still renew (a member that stalled, alive to membership but training
        # nothing, drops out of the line with its claims, which its chunks' next in line then take over).
        members = set(self.live()) | {self.me}
        live = {m for m in members if m == self.me or not self._expired(m, now, members)}
        if now - self._published_at >= self.settings.steal_after:
            self._in_line = self._published  # by now most members have heard it
        buckets = {m: b for m, b in self.table.paces.items() if m != self.me}
        if self._in_line is not None:
            buckets[self.me] = self._in_line
        if self._line.update(sorted(live), buckets):
            self._own_from = 0  # another line: every chunk may be ours now
        lo, hi = self.table.floor, self.table.floor + self.table.window
        held = {h.g for h in self.held}
        # First in line: ours, lowest first, from where the last scan found nothing of ours it could not take (the
        # chunks below it were done, held by us, or others'; a merge or a new line starts over from the floor).
        start = max(lo, self._own_from)
        resume_at = None
        done, claims, me = self.table.done, self.table.claims, self.me
        for g in range(start, hi):
            if need == 0:
                resume_at = g
                break
            if g in held or g in done:
                continue
            c = claims.get(g)
            if c is not None and (c.owner == me or not self._expired(c.owner, now, live)):
                continue  # ours already, or another's that stands (a merge that changes that rescans)
            if self._line.is_first(g, me):
                ok, old = self._free(g, now, live)
                if ok:
                    self._claim(g, old, stolen=False, now=now)
                    need -= 1
                elif resume_at is None:
                    resume_at = g  # ours but held by another for now: look again from here next time
        self._own_from = hi if resume_at is None else resume_at
        if need == 0:
            return
        # None of ours left in the window (we are faster than our weight says, or the window is full): steal.
        # A thief k-th in line for a chunk may take it once the chunk has been in the window k x steal_after,
        # so the better placed had their turn and thieves that all ran out do not all take the same chunk;
        # never a member's next few free chunks, which it is about to claim itself; highest first, away from
        # where the members climb from the bottom.
        if self._floor_seen[0] != lo:
            self._floor_seen = (lo, now)
        # A floor that stands still while chunks are free below others' claims: views that disagree on the line
        # (a pace not heard everywhere yet) can leave a chunk each thinks another's; then reserves do not hold.
        stuck = now - self._floor_seen[1] > 3 * self.settings.steal_after
        reserved = set() if stuck else self._reserves(live, lo, hi, now)
        turns = min(len(live), MAX_TURNS)
        tops = [self._stealable_top(now, k) for k in range(1, turns + 1)]
        # The free chunks of others, best placed first (our place in line, then the highest): a chunk we are
        # second in line for is taken as the scan meets it, highest first, so a scan stops once it has enough
        # of those (the window is thousands of chunks, and a thief claims at nearly every step); the others are
        # ranked only if the scan ends short.
        ranked = []  # (our place in line, at most turns; -chunk)
        for g in range(min(hi, tops[0]) - 1, lo - 1, -1):
            if g in held or g in reserved:
                continue
            free, old = self._free(g, now, live)
            if not free:
                continue
            k = self._line.rank(g, self.me, cap=turns)
            if k == 1:
                self._claim(g, old, stolen=True, now=now)
                need -= 1
                if need == 0:
                    return
            elif k > 1:
                ranked.append((k, -g))
        ranked.sort()
        for k, minus_g in ranked:
            if need == 0:
                return
            g = -minus_g
            if g < tops[k - 1]:
                self._claim(g, self._free(g, now, live)[1], stolen=True, now=now)
                need -= 1

    def _note_top(self, now: float) -> None:
        """Remember when the window's top rose (see ``_stealable_top``)."""
        top = self.table.floor + self.table.window
        if not self._tops or top > self._tops[-1][0]:
            self._tops.append((top, now))

    def _stealable_top(self, now: float, turns: int) -> int:
        """The window's top as it stood ``turns`` x ``steal_after`` seconds ago: chunks that came into the window
        later are left to their own members (and then to their second choices), who learn of them a gossip round
        or two after us (thieves that took them at once collided with their members at every jump of the floor)."""
        self._note_top(now)
        cutoff = now - turns * self.settings.steal_after
        while len(self._tops) > 1 and self._tops[1][1] <= now - 2 * self.settings.steal_after:
            self._tops.popleft()
        return max((top for top, since in self._tops if since <= cutoff), default=self.table.floor)

    def _reserves(self, live: set[str], lo: int, hi: int, now: float) -> set[int]:
        """Each other member's lowest free chunks of its own, as many as it holds claims (at least RESERVE)."""
        holding: dict[str, int] = {}
        for c in self.table.claims.values():
            holding[c.owner] = holding.get(c.owner, 0) + 1
        left = {m: max(RESERVE, holding.get(m, 0)) for m in live if m != self.me}
        out: set[int] = set()
        for g in range(lo, hi):
            if not any(left.values()):
                break
            owner = self._line.owner(g)
            if left.get(owner) and self._free(g, now, live)[0]:
                out.add(g)
                left[owner] -= 1
        return out

    def _claim(self, g: int, old: Claim | None, *, stolen: bool, now: float) -> None:
        claim = Claim(0 if old is None else old.term + 1, self.me)
        if not self.table.put_claim(g, claim):
            return
        bisect.insort(self.held, _Held(g), key=lambda h: h.g)
        self.stats.chunks_claimed += 1
        self.stats.chunks_stolen += stolen
        self.stats.chunks_taken_over += old is not None
        if self._last_beat == -math.inf:
            self._renew(now)

    def _take_back(self, now: float) -> None:
        """Claim again the chunks a checkpoint held that nobody finished or holds now (a holder that is gone or
        silent included: our own earlier incarnation), at the next term, from the samples trained by then."""
        assert self._resume is not None
        members = set(self.live()) | {self.me}
        for g, trained in self._resume:
            ok, old = self._free(g, now, members)
            if old is not None and old.owner == self._was != "":  # ours, from before the restart, alive or not
                ok = not self.table.is_done(g)
            if ok and self.table.in_window(g) and all(h.g != g for h in self.held):
                self._claim(g, old, stolen=False, now=now)
                self.held[[h.g for h in self.held].index(g)].trained = trained
                self.stats.chunks_resumed += 1
        self._resume = None

    def _drop_lost(self) -> None:
        """Claims another member won, or chunks someone finished: drop them, counting what we had trained."""
        kept = []
        for h in self.held:
            c = self.table.claim_of(h.g)
            if self.table.is_done(h.g) or (c is not None and c.owner != self.me):
                self.stats.claims_lost += not self.table.is_done(h.g)
                self.stats.samples_trained_twice += h.trained
            else:
                kept.append(h)
        self.held = kept
