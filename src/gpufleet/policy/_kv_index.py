"""The precise prefix index: which replica's engine holds which KV block, from its KV events.

The approximate index (``_prefix.py``) guesses a replica's cache from what was routed there.
This one is told: each engine publishes numbered batches of ``KvStored`` / ``KvRemoved`` /
``KvCleared`` (docs/kv-events.md), and the index applies them in sequence order, one *feed*
per replica process::

    holders         dict   h → bitmask of replicas whose engine reports h cached
    flight          dict   h → bitmask of replicas with a request in flight whose prompt
                           holds h (about to be cached: events lag the routing decision)
    stored[r]       OrderedDict h → None in store order, at most `capacity` per replica

    feed[r]   incarnation · next_seq · resync_from · pending (batches held during a gap)

A feed is *live* when it has applied the process's batches without a hole; only a live
feed's blocks are matched (:meth:`KvBlockIndex.live_mask`), the other replicas fall back to
the approximate index. Sequence numbers decide what a batch is::

    seq == next_seq        apply it
    seq >  next_seq        a gap (lost batches): hold it, ask for a replay from next_seq
                           (``apply`` returns that seq; the shell asks the engine's replay
                           socket and hands back what it got with ``replay=True``)
    seq <  next_seq        live: the publisher restarted (its count began again) → clear;
                           replayed: already applied → skip

A replay that cannot fill the hole (the engine's buffer no longer holds it, or there is no
replay socket) clears the replica and goes on from the first batch it has: the index then
misses blocks the engine still holds (they come back as it stores again) but never keeps
one the engine dropped. A new incarnation (a restarted process: the controller says so
before any of its events) or a ``KvCleared`` clears the replica too, so a restarted engine's
old prefixes do not draw requests (no ghosts).

A feed is *stale* when a request started on the replica more than ``stale_after`` seconds
ago and no batch came since (its events stopped: a broken subscription); it is matched as
if it had no feed until its next batch.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from gpufleet.fleet import KvBatch, KvCleared, KvRemoved, KvStored, ReplicaId
from gpufleet.policy._prefix import record_depth


class _Feed:
    __slots__ = ("applied", "incarnation", "next_seq", "pending", "resync_from", "waiting_since")

    def __init__(self, incarnation: str | None) -> None:
        self.incarnation = incarnation
        self.next_seq = 0
        self.resync_from: int | None = None
        """The seq a replay was asked from (``None``: no hole)."""
        self.pending: list[KvBatch] = []
        """Live batches that arrived after the hole, in order, until the replay."""
        self.waiting_since: float | None = None
        """When the first request since the last batch started on the replica."""
        self.applied = 0
        """Batches applied (for snapshots and tests)."""


@dataclass(frozen=True, slots=True)
class FeedSnapshot:
    incarnation: str | None
    next_seq: int
    resync_from: int | None
    pending: int
    applied: int
    blocks: int


class KvBlockIndex:
    """Blocks per replica from KV events, their feeds, and blocks in flight. See the module."""

    __slots__ = (
        "_feeds",
        "_flight",
        "_flight_counts",
        "_free",
        "_holders",
        "_owner",
        "_slot",
        "_stored",
        "capacity",
        "max_pending",
        "resyncs",
        "stale_after",
    )

    def __init__(self, capacity: int, *, stale_after: float, max_pending: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"a KV block index needs a capacity of at least 1, got {capacity}")
        self.capacity = capacity
        self.stale_after = stale_after
        self.max_pending = max_pending
        self.resyncs = 0
        """Replays asked for (gaps seen)."""
        self._slot: dict[ReplicaId, int] = {}
        self._owner: dict[int, ReplicaId] = {}
        self._free: list[int] = []
        self._stored: dict[ReplicaId, OrderedDict[int, None]] = {}
        self._holders: dict[int, int] = {}
        self._flight: dict[int, int] = {}
        self._flight_counts: dict[ReplicaId, dict[int, int]] = {}
        self._feeds: dict[ReplicaId, _Feed] = {}

    # -- slots ----------------------------------------------------------------------------

    def _bit(self, replica: ReplicaId) -> int:
        slot = self._slot.get(replica)
        if slot is None:
            slot = heapq.heappop(self._free) if self._free else len(self._slot)
            self._slot[replica] = slot
            self._owner[slot] = replica
        return 1 << slot

    def _release(self, replica: ReplicaId) -> None:
        if replica in self._stored or replica in self._flight_counts or replica in self._feeds:
            return
        slot = self._slot.pop(replica, None)
        if slot is not None:
            del self._owner[slot]
            heapq.heappush(self._free, slot)

    # -- the feed -------------------------------------------------------------------------

    def apply(
        self,
        now: float,
        replica: ReplicaId,
        incarnation: str | None,
        batches: Sequence[KvBatch],
        *,
        replay: bool = False,
    ) -> int | None:
        """Apply ``replica``'s batches (from process ``incarnation``); the seq to replay
        from when a gap opened (``None``: nothing to ask)."""
        feed = self._feeds.get(replica)
        if feed is None or feed.incarnation != incarnation:
            self._clear(replica)
            feed = self._feeds[replica] = _Feed(incarnation)
            self._bit(replica)
        feed.waiting_since = None
        if replay:  # an answer to our ask (one that comes unasked is ignored)
            if feed.resync_from is not None:
                self._replayed(replica, feed, batches)
            return None
        ask: int | None = None
        for batch in batches:
            if feed.resync_from is not None:
                feed.pending.append(batch)
                if len(feed.pending) > self.max_pending:  # the replay never came
                    self._give_up(replica, feed)
                continue
            if batch.seq == feed.next_seq:
                self._apply(replica, feed, batch)
            elif batch.seq > feed.next_seq:
                feed.resync_from = ask = feed.next_seq
                feed.pending.append(batch)
                self.resyncs += 1
            else:  # the count began again: a new publisher behind the same address
                self._clear_blocks(replica)
                self._apply(replica, feed, batch)
        return ask

    def _replayed(self, replica: ReplicaId, feed: _Feed, batches: Sequence[KvBatch]) -> None:
        """A replay's batches, then the batches held since the gap; a hole neither fills
        clears the replica (no ghosts) and the feed goes on from there."""
        held, feed.pending, feed.resync_from = feed.pending, [], None
        for batch in (*batches, *held):
            if batch.seq < feed.next_seq:
                continue  # applied already
            if batch.seq > feed.next_seq:
                self._clear_blocks(replica)
            self._apply(replica, feed, batch)

    def _give_up(self, replica: ReplicaId, feed: _Feed) -> None:
        self._replayed(replica, feed, ())

    def _apply(self, replica: ReplicaId, feed: _Feed, batch: KvBatch) -> None:
        feed.next_seq = batch.seq + 1
        feed.applied += 1
        for event in batch.events:
            if isinstance(event, KvStored):
                self._store(replica, event.hashes)
            elif isinstance(event, KvRemoved):
                self._remove(replica, event.hashes)
            elif isinstance(event, KvCleared):
                self._clear_blocks(replica)

    def restarted(self, replica: ReplicaId, incarnation: str | None) -> None:
        """``replica`` is a new process: its cache starts empty. A replica whose events
        were indexed gets an empty live feed for the new process; one never indexed stays
        unindexed (it may publish nothing)."""
        feed = self._feeds.get(replica)
        if feed is None or feed.incarnation == incarnation:
            return
        self._clear(replica)
        self._feeds[replica] = _Feed(incarnation)
        self._bit(replica)

    def forget(self, replica: ReplicaId) -> None:
        """``replica`` left the pool: drop its blocks and feed (not its requests in flight)."""
        self._clear(replica)
        self._release(replica)

    def _clear(self, replica: ReplicaId) -> None:
        self._clear_blocks(replica)
        self._feeds.pop(replica, None)
        self._stored.pop(replica, None)

    def _clear_blocks(self, replica: ReplicaId) -> None:
        stored = self._stored.get(replica)
        if not stored:
            return
        bit, holders = 1 << self._slot[replica], self._holders
        for h in stored:
            mask = holders[h] & ~bit
            if mask:
                holders[h] = mask
            else:
                del holders[h]
        stored.clear()

    def _store(self, replica: ReplicaId, hashes: Sequence[int]) -> None:
        bit = self._bit(replica)
        stored = self._stored.get(replica)
        if stored is None:
            stored = self._stored[replica] = OrderedDict()
        holders = self._holders
        for h in hashes:
            if h in stored:
                stored.move_to_end(h)
            else:
                stored[h] = None
                holders[h] = holders.get(h, 0) | bit
        while len(stored) > self.capacity:  # the bound: the oldest stored goes first
            old, _ = stored.popitem(last=False)
            self._unhold(old, bit)

    def _remove(self, replica: ReplicaId, hashes: Sequence[int]) -> None:
        stored = self._stored.get(replica)
        if not stored:
            return
        bit = 1 << self._slot[replica]
        for h in hashes:
            if h in stored:
                del stored[h]
                self._unhold(h, bit)

    def _unhold(self, h: int, bit: int) -> None:
        mask = self._holders[h] & ~bit
        if mask:
            self._holders[h] = mask
        else:
            del self._holders[h]

    # -- requests in flight ---------------------------------------------------------------

    def started(self, now: float, replica: ReplicaId, hashes: Sequence[int]) -> None:
        """A request with these prompt blocks started on ``replica``."""
        feed = self._feeds.get(replica)
        if feed is not None and feed.waiting_since is None:
            feed.waiting_since = now
        if not hashes:
            return
        bit = self._bit(replica)
        counts = self._flight_counts.get(replica)
        if counts is None:
            counts = self._flight_counts[replica] = {}
        flight = self._flight
        for h in hashes:
            n = counts.get(h, 0)
            counts[h] = n + 1
            if not n:
                flight[h] = flight.get(h, 0) | bit

    def ended(self, replica: ReplicaId, hashes: Sequence[int]) -> None:
        """That request's attempt on ``replica`` ended."""
        counts = self._flight_counts.get(replica)
        if counts is None or not hashes:
            return
        bit, flight = 1 << self._slot[replica], self._flight
        for h in hashes:
            n = counts.get(h, 0) - 1
            if n > 0:
                counts[h] = n
            elif n == 0:
                del counts[h]
                mask = flight[h] & ~bit
                if mask:
                    flight[h] = mask
                else:
                    del flight[h]
        if not counts:
            del self._flight_counts[replica]
            self._release(replica)

    # -- questions ------------------------------------------------------------------------

    def live(self, now: float) -> frozenset[ReplicaId]:
        """Replicas whose feed is live (no hole, not stale) now."""
        return frozenset(r for r, feed in self._feeds.items() if self._is_live(now, feed))

    def _is_live(self, now: float, feed: _Feed) -> bool:
        waiting = feed.waiting_since
        return feed.resync_from is None and (waiting is None or now - waiting <= self.stale_after)

    def match(self, now: float, hashes: Sequence[int]) -> dict[ReplicaId, int]:
        """Per live replica holding the first block (cached, or in flight there), how many
        leading blocks of ``hashes`` it holds."""
        if not hashes or not self._feeds:
            return {}
        live = 0
        for replica, feed in self._feeds.items():
            if self._is_live(now, feed):
                live |= 1 << self._slot[replica]
        holders, flight = self._holders, self._flight
        alive = (holders.get(hashes[0], 0) | flight.get(hashes[0], 0)) & live
        if not alive:
            return {}
        matched: dict[ReplicaId, int] = {}
        for depth in range(1, len(hashes)):
            h = hashes[depth]
            still = alive & (holders.get(h, 0) | flight.get(h, 0))
            if still != alive:
                record_depth(self._owner, alive & ~still, depth, matched)
                if not still:
                    return matched
                alive = still
        record_depth(self._owner, alive, len(hashes), matched)
        return matched

    def holds(self, replica: ReplicaId, h: int) -> bool:
        """Whether ``replica``'s engine reported ``h`` cached (and not removed since)."""
        stored = self._stored.get(replica)
        return stored is not None and h in stored

    def size(self, replica: ReplicaId) -> int:
        stored = self._stored.get(replica)
        return 0 if stored is None else len(stored)

    def feeds(self) -> dict[ReplicaId, FeedSnapshot]:
        return {
            r: FeedSnapshot(
                f.incarnation,
                f.next_seq,
                f.resync_from,
                len(f.pending),
                f.applied,
                self.size(r),
            )
            for r, f in self._feeds.items()
        }

    def check(self) -> None:
        """Assert the structures agree and the bound holds (for tests)."""
        for replica, stored in self._stored.items():
            assert len(stored) <= self.capacity, f"{replica}: {len(stored)} > {self.capacity}"
            bit = 1 << self._slot[replica]
            for h in stored:
                assert self._holders[h] & bit, f"{replica}: {h} missing from holders"
        for h, mask in self._holders.items():
            assert mask, f"{h}: empty holder mask"
            for slot, replica in self._owner.items():
                held = h in self._stored.get(replica, ())
                assert bool(mask & (1 << slot)) == held, (h, replica)
        for h, mask in self._flight.items():
            for slot, replica in self._owner.items():
                counted = h in self._flight_counts.get(replica, {})
                assert bool(mask & (1 << slot)) == counted, (h, replica)
