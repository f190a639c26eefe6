"""Continuous batching: which tokens of which requests run in the next step.

Computed tokens catch up with tokens; there is no prefill phase. Every request has
``num_tokens`` (prompt + generated so far) and ``num_computed_tokens`` (in its KV cache), and a
step schedules some of the difference for each request it takes. A step that closes the gap
samples one token, which opens it by one again::

    prompt 9 tokens, token budget 4 per step          (= computed, . not yet, + sampled)

    step 1   ====.....       chunk of 4  (0 -> 4)
    step 2   ========.       chunk of 4  (4 -> 8)
    step 3   =========+      chunk of 1  (8 -> 9): gap closed, first token sampled
    step 4   ==========+     decode: 1 token (the one sampled last step), samples the next

A "decode" is just a request whose gap is one token. The conserved quantity, at every point
between steps, for every request::

    0 <= num_computed_tokens <= num_tokens = num_prompt_tokens + num_output_tokens

Each step fills a token budget (``max_num_batched_tokens``) in two passes, as vLLM v1 does:

1. the running pass: every running request in order (decodes and continuing chunks); when the
   KV cache cannot hold a request's new tokens, the newest running request (or, under the
   priority policy, the lowest-priority one) is preempted until it can;
2. the waiting pass: waiting requests while budget, KV blocks and ``max_num_seqs`` allow,
   starting from their longest cached prefix. Skipped in a step that preempted anything.
"""

from __future__ import annotations

from gpufleet.engine.model._kv_cache import KVCacheManager
from gpufleet.engine.model._queues import FCFSQueue, PriorityQueue, WaitingQueue
from gpufleet.engine.model._request import Request, RequestStatus


class Budget:
    """One step being built: the tokens left and what has been scheduled so far.

    The batch shape is summed as requests are added (O(1) each): a prompt chunk of ``n``
    tokens on top of ``c`` computed ones attends ``n·c + n(n+1)/2`` positions and reads
    ``c + n`` tokens of KV; a decode attends its context (its tokens in KV after this step).
    """

    __slots__ = (
        "decode_context",
        "decodes",
        "preempted",
        "prefill_attn_context",
        "prefill_context",
        "prefill_tokens",
        "prefills",
        "tokens",
    )

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.decodes: list[Request] = []
        self.decode_context = 0
        self.prefills: list[tuple[Request, int, int]] = []
        """(request, computed before, new tokens) per prompt chunk."""
        self.prefill_tokens = 0
        self.prefill_attn_context = 0
        self.prefill_context = 0
        self.preempted = False

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    def add_prefill(self, request: Request, start: int, count: int) -> None:
        self.prefills.append((request, start, count))
        self.prefill_tokens += count
        self.prefill_attn_context += count * start + count * (count + 1) // 2
        self.prefill_context += start + count
        self.tokens -= count

    def drop(self, request: Request) -> None:
        """Take back whatever ``request`` was given in this step, its computed tokens included
        (it is being preempted: the tokens will not run)."""
        if request in self.decodes:
            self.decodes.remove(request)
            self.decode_context -= request.num_computed_tokens
            self.tokens += 1
            request.num_computed_tokens -= 1
            return
        for entry in self.prefills:
            if entry[0] is request:
                _, start, count = entry
                self.prefills.remove(entry)
                self.prefill_tokens -= count
                self.prefill_attn_context -= count * start + count * (count + 1) // 2
                self.prefill_context -= start + count
                self.tokens += count
                request.num_computed_tokens = start
                return


class Scheduler:
    """Waiting and running queues over one KV cache manager."""

    __slots__ = (
        "kv",
        "max_num_batched_tokens",
        "max_num_seqs",
        "num_preemptions",
        "prefix_cache_hits",
        "prefix_cache_queries",
        "priority",
        "running",
        "waiting",
    )

    def __init__(
        self, kv: KVCacheManager, *, max_num_batched_tokens: int, max_num_seqs: int, policy: str
    ) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.priority = policy == "priority"
        self.waiting: WaitingQueue = PriorityQueue() if self.priority else FCFSQueue()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add(self, request: Request) -> None:
        self.waiting.push(request)

    def remove(self, request: Request) -> None:
        """Take ``request`` out of its queue and free its blocks (it is finished)."""
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED

    def finish(self, requests: list[Request]) -> None:
        """``requests`` are done: free their blocks and take them out of the running queue."""
        for request in requests:
            self.kv.free(request)
            request.status = RequestStatus.FINISHED
        self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]

    def schedule(self) -> Budget:
        """Build the next step (an empty budget when there is nothing to run)."""
        while True:
            budget = Budget(self.max_num_batched_tokens)
            self._schedule_running(budget)
            if not budget.preempted:
                self._schedule_waiting(budget)
            if not (budget.is_empty and budget.preempted):
                return budget
            # Under the priority policy the first request of the pass may preempt itself and
            # end it with nothing scheduled (vLLM then runs an empty step). Plan again: each
            # round moves a request to waiting, and a request alone always fits.

    def _schedule_running(self, budget: Budget) -> None:
        # The hot loop (every running request, every step). Budget fields live in locals and
        # go back to ``budget`` around the rare calls that read or change them. It walks a
        # copy of the queue: preemption removes requests from ``self.running`` as it goes.
        decodes = budget.decodes
        left = budget.tokens
        context = 0
        preempted = False
        for request in list(self.running):
            if left <= 0:
                break
            if preempted and request.status is not RequestStatus.RUNNING:
                continue  # a victim of this step
            start = request.num_computed_tokens
            gap = request.num_tokens - start
            count = gap if gap <= left else left
            end = start + count
            if end >= request.kv_checkpoint and self.kv.allocate(request, end) is None:
                budget.tokens, budget.decode_context = left, budget.decode_context + context
                context = 0
                fits = self._make_room(request, end, budget)
                left, preempted = budget.tokens, True
                if not fits:
                    break  # it preempted itself: the pass ends here, as in vLLM
            request.num_computed_tokens = end
            if gap == 1 and request.num_output_tokens:  # a decode
                decodes.append(request)
                context += end
                left -= 1
            else:
                budget.tokens = left
                budget.add_prefill(request, start, count)
                left = budget.tokens
        budget.tokens, budget.decode_context = left, budget.decode_context + context

    def _schedule_waiting(self, budget: Budget) -> None:
        waiting, running, kv = self.waiting, self.running, self.kv
        while waiting and budget.tokens > 0 and len(running) < self.max_num_seqs:
            request = waiting.peek()
            hits = kv.lookup(request)
            cached = len(hits) * kv.block_size
            count = min(request.num_tokens - cached, budget.tokens)
            if kv.allocate(request, cached + count, hits) is None:
                break  # first come, first served: nobody overtakes the head of the queue
            waiting.pop()
            running.append(request)
            request.status = RequestStatus.RUNNING
            if request.num_preemptions == 0:  # first scheduling: fix its cache statistics
                request.num_cached_tokens = cached
                if kv.caching:
                    self.prefix_cache_queries += request.num_tokens
                    self.prefix_cache_hits += cached
            request.num_computed_tokens = cached + count
            budget.add_prefill(request, cached, count)

    def _make_room(self, request: Request, end: int, budget: Budget) -> bool:
        """``request``'s slots up to ``end`` do not fit: preempt until they do.

        False when ``request`` had to preempt itself.
        """
        while True:
            victim = self._victim()
            self._preempt(victim, budget)
            if victim is request:
                return False
            if self.kv.allocate(request, end) is not None:
                return True

    def _victim(self) -> Request:
        """The newest running request, or the lowest-priority (then newest) under priority."""
        if self.priority:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time, r.seq))
        return self.running[-1]

    def _preempt(self, victim: Request, budget: Budget) -> None:
        """Recompute mode: free its blocks, forget its computed tokens, keep its output.

        Its full computed blocks stay in the prefix cache (until evicted), so it may get some
        of them back when it is scheduled again.
        """
        if self.priority:
            budget.drop(victim)  # it may have been scheduled earlier in this pass
        if self.running[-1] is victim:
            self.running.pop()
        else:
            self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.WAITING
        self.waiting.push_front(victim)
        self.num_preemptions += 1
        budget.preempted = True
