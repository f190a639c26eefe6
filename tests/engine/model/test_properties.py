"""L1: state machines over the block pool and the whole replica model (Hypothesis).

Invariants checked after every rule:

* block pool: free + used = total; no block both free and referenced; ref counts >= 0 and
  equal to how often the block tables hold each block; freeing returns exactly the blocks;
* replica: the queues, the request table and the pool agree; computed <= tokens; KV usage in
  [0, 1]; and every request finishes once the replica is driven to completion, with exactly
  ``max_tokens`` tokens when it ignores EOS (a pooling request: one output, no token).
"""

from __future__ import annotations

from collections import Counter

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from gpufleet.engine.model import FinishReason, NewRequest, ReplicaModel, RequestOutput
from gpufleet.engine.model._block_pool import BlockPool

from .factories import Driver, make_config

# -- the block pool ---------------------------------------------------------------------------


class BlockPoolMachine(RuleBasedStateMachine):
    """Holders take, share (cache hits), register and release blocks in any order."""

    holders = Bundle("holders")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(12)
        self.tables: dict[int, list[int]] = {}
        self.next_holder = 0
        self.hashes = 0

    @rule(target=holders, count=st.integers(0, 6))
    def take(self, count: int) -> int:
        free_before = self.pool.num_free
        blocks = self.pool.take(count)
        if blocks is None:
            assert count > free_before
            blocks = []
        assert len(set(blocks)) == len(blocks)
        holder = self.next_holder
        self.next_holder += 1
        self.tables[holder] = blocks
        return holder

    @rule(holder=holders, data=st.data())
    def register(self, holder: int, data: st.DataObject) -> None:
        unnamed = [b for b in self.tables.get(holder, []) if self.pool.block_hash(b) is None]
        if unnamed:
            block = data.draw(st.sampled_from(unnamed))
            self.hashes += 1
            name = data.draw(st.integers(1, self.hashes)).to_bytes(4, "little")  # may repeat
            if self.pool.register(block, name):
                assert self.pool.cached_block(name) == block
            else:
                assert self.pool.cached_block(name) not in (None, block)

    @rule(target=holders, data=st.data())
    def hit(self, data: st.DataObject) -> int:
        """A new holder shares some cached blocks, as a prefix-cache hit does."""
        cached = [b for b in range(self.pool.num_blocks) if self.pool.block_hash(b) is not None]
        picked = data.draw(st.lists(st.sampled_from(cached), unique=True)) if cached else []
        self.pool.touch(picked)
        holder = self.next_holder
        self.next_holder += 1
        self.tables[holder] = picked
        return holder

    @rule(holder=consumes(holders))
    def release(self, holder: int) -> None:
        blocks = self.tables.pop(holder, [])
        free_before = set(self.pool.free_queue())
        self.pool.release(reversed(blocks))
        newly_free = set(self.pool.free_queue()) - free_before
        still_held = {b for table in self.tables.values() for b in table}
        assert newly_free == set(blocks) - still_held

    @invariant()
    def consistent(self) -> None:
        self.pool.check(list(self.tables.values()))


TestBlockPool = BlockPoolMachine.TestCase
TestBlockPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -- the replica model ------------------------------------------------------------------------


class ReplicaMachine(RuleBasedStateMachine):
    """Requests arrive, get aborted (also mid-step) and run on a tiny, contended replica."""

    @initialize(
        blocks=st.integers(8, 24),
        block_size=st.sampled_from([2, 4, 16]),
        budget=st.integers(4, 64),
        seqs=st.integers(1, 6),
        policy=st.sampled_from(["fcfs", "priority"]),
        caching=st.booleans(),
    )
    def setup(
        self,
        *,
        blocks: int,
        block_size: int,
        budget: int,
        seqs: int,
        policy: str,
        caching: bool,
    ) -> None:
        config = make_config(
            num_gpu_blocks_override=blocks,
            block_size=block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=seqs,
            scheduling_policy=policy,
            enable_prefix_caching=caching,
        )
        self.model = ReplicaModel(config)
        self.driver = Driver(self.model)
        self.live: dict[str, NewRequest] = {}
        self.aborted: set[str] = set()
        self.requests: dict[str, NewRequest] = {}
        self.count = 0

    @rule(data=st.data(), count=st.integers(1, 3))
    def add(self, data: st.DataObject, count: int) -> None:
        # Sizes scale with the context window, so requests contend for the tiny cache; prompts
        # share one of a few prefixes, so the prefix cache is exercised.
        third = max(1, self.model.max_model_len // 3)
        for _ in range(count):
            shared = data.draw(st.sampled_from([0, third // 2, third]))
            own = data.draw(st.integers(1, third))
            start = 5000 + 1000 * self.count
            prompt = tuple(range(7, 7 + shared)) + tuple(range(start, start + own))
            rid = f"r{self.count}"
            self.count += 1
            new = NewRequest(
                rid,
                prompt,
                max_tokens=data.draw(st.integers(1, third)),
                ignore_eos=data.draw(st.booleans()),
                priority=data.draw(st.integers(0, 2)),
                pooling=data.draw(st.sampled_from([False, False, False, True])),
            )
            self.driver.add(new)
            self.live[rid] = new
            self.requests[rid] = new

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        pool = self.model._kv.pool
        held = self.model.blocks_of(rid)
        refs = {block: pool.ref_count(block) for block in held}
        assert self.model.abort(rid, self.driver.now)
        # Exactly its blocks lose a reference; those it alone held are free at once.
        assert {b: pool.ref_count(b) for b in held} == {b: n - 1 for b, n in refs.items()}
        assert {b for b, n in refs.items() if n == 1} <= set(pool.free_queue())
        del self.live[rid]
        self.aborted.add(rid)

    @rule()
    def step(self) -> None:
        self._note(self.driver.step())

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort_during_a_step(self, data: st.DataObject) -> None:
        plan = self.model.plan_step(self.driver.now)
        assert plan is not None
        rid = data.draw(st.sampled_from(sorted(self.live)))
        assert self.model.abort(rid, self.driver.now)
        del self.live[rid]
        self.aborted.add(rid)
        self.driver.now += plan.duration
        outs = self.model.finish_step(plan, self.driver.now)
        assert rid not in {out.request_id for out in outs}
        for out in outs:
            self.driver.outputs[out.request_id].append(out)
        self._note(outs)

    @rule()
    def drain(self) -> None:
        """Drive to completion: every live request finishes, with all its tokens."""
        for _ in range(20_000):
            if not self.model.has_work():
                break
            self._note(self.driver.step())
        assert not self.live, f"never finished: {sorted(self.live)}"
        stats = self.model.stats()
        event(f"preempted: {stats.num_preemptions > 0}")
        event(f"prefix cache hit: {stats.prefix_cache_hits > 0}")
        for rid, new in self.requests.items():
            if rid in self.aborted:
                continue
            outs = self.driver.outputs[rid]
            if new.pooling:  # one output, no token, when the prompt is computed
                assert [(o.new_token_ids, o.finish_reason) for o in outs] == [
                    ((), FinishReason.STOP)
                ]
                continue
            assert [o.num_output_tokens for o in outs] == list(range(1, len(outs) + 1))
            assert 1 <= len(outs) <= new.max_tokens
            if new.ignore_eos:
                assert len(outs) == new.max_tokens
            expected = FinishReason.LENGTH if len(outs) == new.max_tokens else FinishReason.STOP
            assert outs[-1].finish_reason is expected

    def teardown(self) -> None:
        if hasattr(self, "model"):
            self.drain()

    def _note(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            if out.finish_reason is not None:
                del self.live[out.request_id]

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "model"):
            return
        self.model.check_invariants()
        stats = self.model.stats()
        assert 0.0 <= stats.kv_cache_usage <= 1.0
        assert stats.num_running + stats.num_waiting == len(self.live)
        finished = Counter({k: v for k, v in stats.finished.items() if v})
        assert finished["abort"] == len(self.aborted)


TestReplica = ReplicaMachine.TestCase
TestReplica.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
