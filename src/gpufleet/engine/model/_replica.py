"""The replica model: one vLLM-like engine replica, driven step by step by a shell.

The shell owns the clock. It asks for the next step, lets ``plan.duration`` pass (really or
virtually) and hands the plan back::

    model = ReplicaModel(ReplicaConfig(get_model("llama-3.1-8b"), get_gpu("h100-sxm")))
    model.add_request(NewRequest("r1", prompt_token_ids=(1, 2, 3), max_tokens=16), now=0.0)
    now = 0.0
    while (plan := model.plan_step(now)) is not None:
        now += plan.duration
        for out in model.finish_step(plan, now):
            ...  # stream out.new_token_ids; out.finish_reason ends the request

``add_request`` and ``abort`` may come between ``plan_step`` and ``finish_step``; an aborted
request's share of the step in flight is dropped and produces no output.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from itertools import accumulate, islice
from operator import add
from typing import Final

from gpufleet.engine.model._kv_cache import KVCacheManager
from gpufleet.engine.model._kv_events import KvCacheEvent
from gpufleet.engine.model._request import Request, RequestStatus
from gpufleet.engine.model._scheduler import Scheduler
from gpufleet.engine.model._tokens import FillerTokens, OutputLengths, shared_filler
from gpufleet.engine.model._types import (
    DecodeRun,
    FinishReason,
    NewRequest,
    Progress,
    ReplicaConfig,
    ReplicaStats,
    RequestOutput,
    StepPlan,
)
from gpufleet.perf import (
    BatchShape,
    EngineLimits,
    MemoryPlan,
    Parallelism,
    StepTimeModel,
    memory_plan,
)

_Run = tuple[list[Request], dict[int, list[Request]], list[int], int, list[float], int]
"""A priced run (``ReplicaModel._decode_run``): running requests, crossings by phase, phases,
steps, the durations memo and the run's first index in it."""


class RunAhead:
    """A run of pure-decode steps priced and not applied (``ReplicaModel.decode_run_ahead``):
    when each step ends, and what the replica would show at an instant inside the run had it
    been caught up to there (``run_decodes(start, now)``, then ``plan_step``)."""

    __slots__ = ("_blocks", "_crossings", "_seqs", "_size", "_used", "times")

    def __init__(
        self,
        times: list[float],
        *,
        seqs: int,
        used: int,
        blocks: int,
        size: int,
        crossings: list[tuple[int, int]],
    ) -> None:
        self.times = times
        """``times[0]`` the run's start, ``times[i + 1]`` the end of its step ``i``."""
        self._seqs = seqs
        self._used = used
        self._blocks = blocks
        self._size = size
        self._crossings = crossings
        """``(phase, requests)``: that many requests take a block at step ``phase`` of the
        run, then every ``size`` steps."""

    @property
    def end(self) -> float:
        return self.times[-1]

    @property
    def steps(self) -> int:
        return len(self.times) - 1

    def load_at(self, now: float) -> tuple[int, int, float]:
        """``(num_running, num_waiting, kv_cache_usage)`` of the replica caught up to ``now``
        (``start <= now <= end``), as :meth:`ReplicaModel.load` would then say.

        Caught up, the steps that ended before ``now`` are applied and the step in flight at
        ``now`` is planned: its crossings have their blocks too. Nobody waits in a run.
        """
        times = self.times
        if not times[0] <= now <= times[-1]:
            raise ValueError(f"{now} is outside the run ({times[0]} to {times[-1]})")
        flight = bisect_left(times, now, 1) - 1  # the steps that ended before now
        size = self._size
        taken = sum(
            need * ((flight - phase) // size + 1)
            for phase, need in self._crossings
            if phase <= flight
        )
        return self._seqs, 0, (self._used + taken) / self._blocks


_Priced = tuple[RunAhead, _Run]


def step_model(config: ReplicaConfig) -> StepTimeModel:
    """The step-time model a replica of ``config`` is timed by."""
    return StepTimeModel(
        config.model,
        config.gpu,
        tp=config.tp,
        pp=config.pp,
        weights_dtype=config.weights_dtype,
        kv_dtype=config.kv_dtype,
    )


PREFILL_PROBE_TOKENS: Final = 2048
"""The prompt length ``prefill_seconds_per_token`` prices (a typical chat prompt)."""


def prefill_seconds_per_token(config: ReplicaConfig) -> float:
    """Seconds per prompt token of one ``PREFILL_PROBE_TOKENS``-token prefill on an idle
    replica of ``config``: what the pool controller predicts a latency budget by."""
    return step_model(config).prefill_time(PREFILL_PROBE_TOKENS) / PREFILL_PROBE_TOKENS


class ReplicaModel:
    """Continuous batching over a paged KV cache with prefix caching, timed by ``perf``."""

    def __init__(self, config: ReplicaConfig) -> None:
        self._config = config
        self._steps = step_model(config)
        self._num_gpu_blocks = _num_gpu_blocks(config)
        self._max_model_len = _max_model_len(config, self._num_gpu_blocks)
        self._filler = shared_filler(config.seed, config.model.vocab_size)
        self._lengths = OutputLengths(
            config.seed, config.output_len_median, config.output_len_sigma
        )
        self._kv = KVCacheManager(
            self._num_gpu_blocks,
            config.block_size,
            caching=config.enable_prefix_caching,
            filler=self._filler,
            events=config.kv_events,
        )
        self._scheduler = Scheduler(
            self._kv,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            policy=config.scheduling_policy,
        )
        self._requests: dict[str, Request] = {}
        self._arrivals = 0
        self._step = 0
        self._in_flight: StepPlan | None = None
        self._slowdown = 1.0
        self._run_durations: tuple[int, int, float, list[float]] = (0, 0, 1.0, [])
        """``(seqs, context, slowdown, durations)``: the decode-step durations last computed,
        ``durations[i] = decode_seconds(seqs, context + i·seqs) × slowdown`` (see
        :meth:`_durations`)."""
        self._priced: _Priced | None = None
        """The run :meth:`decode_run_ahead` priced last, while the state it priced holds (every
        change drops it): :meth:`run_decodes` from its start reads it instead of pricing again."""
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished = dict.fromkeys((reason.value for reason in FinishReason), 0)

    # -- configuration ------------------------------------------------------------------

    @property
    def config(self) -> ReplicaConfig:
        return self._config

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + completion) a request may ask for."""
        return self._max_model_len

    @property
    def num_gpu_blocks(self) -> int:
        return self._num_gpu_blocks

    @property
    def step_time_model(self) -> StepTimeModel:
        return self._steps

    def memory_plan(self) -> MemoryPlan:
        """One GPU of this replica (the most loaded one) as ``perf.memory_plan`` lays it out:
        weights, activation workspace, overhead and the KV budget. ``num_gpu_blocks`` is the
        plan's ``kv_blocks`` unless ``num_gpu_blocks_override`` set it."""
        return _memory_plan(self._config)

    @property
    def slowdown(self) -> float:
        return self._slowdown

    def set_slowdown(self, factor: float) -> None:
        """Fault injection: every step takes ``factor`` times as long (1.0 restores)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"slowdown factor must be a finite number > 0, got {factor}")
        self._slowdown = factor
        self._priced = None

    # -- requests -----------------------------------------------------------------------

    def add_request(self, request: NewRequest, now: float) -> None:
        """Queue ``request`` (arrival time ``now``); ``ValueError`` when it cannot be served."""
        self._priced = None
        self._validate(request)
        if request.pooling:
            target, offset = 0, 0
        else:
            draw = self._lengths.draw(
                request.request_id, request.max_tokens, ignore_eos=request.ignore_eos
            )
            target, offset = draw.target_output_tokens, draw.output_offset
            if request.continues_at is not None:
                offset = request.continues_at
        state = Request(
            request,
            arrival_time=now,
            seq=self._arrivals,
            target_output_tokens=target,
            output_offset=offset,
        )
        self._arrivals += 1
        self._requests[request.request_id] = state
        self._scheduler.add(state)

    def abort(self, request_id: str, now: float) -> bool:
        """Cancel a request and free its KV blocks now; False if it is unknown or finished."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        self._priced = None
        self._scheduler.remove(state)
        self._finished[FinishReason.ABORT.value] += 1
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (a sleeping engine drops its KV cache); ``False``, and
        nothing forgotten, while a request holds blocks or a step is in flight."""
        if self._requests or self._in_flight is not None:
            return False
        self._priced = None
        return self._kv.pool.reset_cache()

    def has_work(self) -> bool:
        return bool(self._scheduler.running) or bool(self._scheduler.waiting)

    # -- steps --------------------------------------------------------------------------

    def plan_step(self, now: float) -> StepPlan | None:
        """Decide the next iteration and reserve its KV blocks; ``None`` when idle."""
        if self._in_flight is not None:
            raise RuntimeError(
                f"plan_step called while step {self._in_flight.step} is in flight; "
                "call finish_step with its plan first"
            )
        if not self.has_work():
            return None
        self._priced = None
        budget = self._scheduler.schedule()
        if budget.is_empty:  # max_model_len <= KV capacity makes this impossible
            raise RuntimeError("the scheduler found work but scheduled nothing (a bug)")
        batch = BatchShape(
            prefill_tokens=budget.prefill_tokens,
            prefill_seqs=len(budget.prefills),
            prefill_attn_context=budget.prefill_attn_context,
            prefill_context=budget.prefill_context,
            decode_seqs=len(budget.decodes),
            decode_context=budget.decode_context,
        )
        timing = self._steps.step_time(batch)
        plan = StepPlan(
            duration=timing.seconds * self._slowdown,
            batch=batch,
            step=self._step,
            decodes=tuple(budget.decodes),
            prefills=tuple((request, count) for request, _, count in budget.prefills),
            timing=timing,
        )
        self._step += 1
        self._in_flight = plan
        return plan

    def finish_step(self, plan: StepPlan, now: float) -> list[RequestOutput]:
        """Apply a step that has run: sample tokens, finish requests, free their blocks.

        One output per request that generated a token, decodes first, in scheduling order.
        """
        if plan is not self._in_flight:
            raise ValueError(
                f"finish_step got step {plan.step}, but the step in flight is "
                f"{'none' if self._in_flight is None else self._in_flight.step}"
            )
        self._in_flight = None
        outputs: list[RequestOutput] = []
        append, output = outputs.append, RequestOutput
        done: list[Request] = []
        running = RequestStatus.RUNNING
        ids, mask = self._filler.ids, self._filler.mask
        # Decodes, inlined: the hot loop (one token each, never the first).
        for r in plan.decodes:
            if r.status is not running:  # aborted while the step ran
                continue
            produced = r.num_output_tokens + 1
            r.num_output_tokens = produced
            r.num_tokens += 1
            reason = None
            if produced >= r.target_output_tokens:
                reason = FinishReason.LENGTH if produced >= r.max_tokens else FinishReason.STOP
                done.append(r)
            append(
                output(
                    r.request_id,
                    (ids[(r.output_offset + produced - 1) & mask],),
                    r.num_prompt_tokens,
                    r.num_cached_tokens,
                    produced,
                    reason,
                    False,
                )
            )
        pooled = 0
        for r, _ in plan.prefills:
            if r.status is running and r.num_computed_tokens == r.num_tokens:
                if r.pooling:
                    outputs.append(self._pool(r, done))
                    pooled += 1
                else:
                    outputs.append(self._sample(r, done))
        if done:
            self._finish(done)
        self._generation_tokens += len(outputs) - pooled
        return outputs

    def _pool(self, r: Request, done: list[Request]) -> RequestOutput:
        """Pooling request ``r`` has computed its prompt: it finishes, with no token."""
        self._prompt_tokens += r.num_prompt_tokens
        done.append(r)
        return RequestOutput(
            r.request_id, (), r.num_prompt_tokens, r.num_cached_tokens, 0, FinishReason.STOP, False
        )

    def _sample(self, r: Request, done: list[Request]) -> RequestOutput:
        """``r`` has caught up with its tokens: it produces the next one."""
        produced = r.num_output_tokens + 1
        r.num_output_tokens = produced
        r.num_tokens += 1
        if produced == 1:
            self._prompt_tokens += r.num_prompt_tokens
        reason = None
        if produced >= r.target_output_tokens:
            reason = FinishReason.LENGTH if produced >= r.max_tokens else FinishReason.STOP
            done.append(r)
        return RequestOutput(
            r.request_id,
            (self._filler.token(r.output_offset + produced - 1),),
            r.num_prompt_tokens,
            r.num_cached_tokens,
            produced,
            reason,
            produced == 1,
        )

    def _finish(self, done: list[Request]) -> None:
        finished = self._finished
        for r in done:
            del self._requests[r.request_id]
            reason = (
                FinishReason.LENGTH
                if r.num_output_tokens >= r.max_tokens and not r.pooling
                else FinishReason.STOP
            )
            finished[reason.value] += 1
        self._scheduler.finish(done)

    def run_decodes(self, now: float, until: float) -> DecodeRun | None:
        """Apply at once the pure-decode steps that would run from ``now`` and end before
        ``until``; ``None``, with nothing changed, when not even one qualifies.

        The state afterwards is exactly the state after ``plan_step`` / ``finish_step`` of the
        same steps one by one (``t = now``; ``t += plan.duration``), minus the plans and the
        outputs. A step qualifies while:

        * nothing is waiting and every running request is a decode (one token behind, some
          output), all in one step (no more than ``max_num_batched_tokens``);
        * no request finishes in it: the finishing step stays an ordinary step, so finishes
          reach the shell through ``finish_step``, at their instant and in their order;
        * it ends before ``until`` (``t + duration < until``): the shell promises that nothing
          reads or changes the replica before ``until``, so at ``until`` it must look exactly
          as the slow path would leave it, not a step further;
        * the requests that cross a block boundary in it get their blocks, in running order
          (one each). When the pool cannot give them all, none is allocated and the step is
          left to ``plan_step``, which preempts.

        The run's steps, with ``n`` running requests and ``C`` = Σ (computed + 1)::

            step i (from 0)     decode_context = C + i·n      duration_i = decode_seconds × slowdown
            request r crosses   at i = kv_checkpoint_r - computed_r - 1, then every block_size

        ``RuntimeError`` while a step is in flight, as ``plan_step``; ``ValueError`` for a
        NaN time.
        """
        self._check_idle("run_decodes")
        if math.isnan(now) or math.isnan(until):
            raise ValueError(f"run_decodes needs times, got now={now} until={until}")
        priced = self._priced
        times: list[float] | None = None
        if priced is not None and priced[0].times[0] == now:
            times, run = priced[0].times, priced[1]
        else:
            fresh = self._decode_run()
            if fresh is None:
                return None
            run = fresh
        running, crossings, phases, steps, known, base = run
        if until != math.inf:
            # the steps that end before ``until``: t is summed one duration at a time, as
            # the step-by-step shell sums it (accumulate adds left to right)
            if times is None:
                times = list(accumulate(islice(known, base, base + steps), add, initial=now))
            steps = bisect_left(times, until, 1, steps + 1) - 1
            if not steps:
                return None
        self._priced = None
        # the steps' crossings in step order: the same allocate calls, in the same order,
        # as the steps' running passes (the blocks are there: _decode_run counted them)
        size, grow = self._kv.block_size, self._kv.grow
        for block_start in range(0, steps, size):
            for phase in phases:
                step = block_start + phase
                if step >= steps:
                    break
                grown = grow([(r, r.num_computed_tokens + 1 + step) for r in crossings[phase]])
                assert grown, "a run's crossing found too few free blocks"
        for r in running:
            r.num_computed_tokens += steps
            r.num_tokens += steps
            r.num_output_tokens += steps
        self._generation_tokens += len(running) * steps
        first = self._step
        self._step += steps
        return DecodeRun(
            tuple(islice(known, base, base + steps)),
            tuple(r.request_id for r in running),
            first,
            times=None if times is None else times[: steps + 1],
        )

    def decode_run_end(self, now: float) -> tuple[float, int] | None:
        """Where ``run_decodes(now, math.inf)`` would end, and after how many steps, with
        nothing changed; ``None`` when it would apply no step.

        A shell that does not know when it will next be looked at (the fleet simulator's
        lazy fast-forward) schedules itself for that end, and applies the run only then, or
        earlier up to the instant someone looks (``run_decodes(now, until)``). The end time
        is summed exactly as ``run_decodes`` sums it, so the two agree to the bit. Blocks are
        counted, not taken: each request that crosses a block boundary needs one, and a run
        stops at the step whose crossings the free blocks cannot all cover, as ``grow`` does.
        """
        ahead = self.decode_run_ahead(now)
        return None if ahead is None else (ahead.end, ahead.steps)

    def decode_run_ahead(self, now: float) -> RunAhead | None:
        """:meth:`decode_run_end`, with what a shell needs to answer for the replica at any
        instant of the run without applying it: each step's end time and the load a scrape
        would see (:meth:`RunAhead.load_at`). Valid until the model is next changed."""
        self._check_idle("decode_run_end")
        run = self._decode_run()
        if run is None:
            return None
        running, crossings, phases, steps, known, base = run
        times = list(accumulate(islice(known, base, base + steps), add, initial=now))
        pool = self._kv.pool
        ahead = RunAhead(
            times,
            seqs=len(running),
            used=pool.num_blocks - pool.num_free,
            blocks=pool.num_blocks,
            size=self._kv.block_size,
            crossings=[(phase, len(crossings[phase])) for phase in phases],
        )
        self._priced = (ahead, run)
        return ahead

    def _check_idle(self, name: str) -> None:
        if self._in_flight is not None:
            raise RuntimeError(
                f"{name} called while step {self._in_flight.step} is in flight; "
                "call finish_step with its plan first"
            )

    def _decode_run(self) -> _Run | None:
        """The run of pure-decode steps from the state now, priced: its running requests,
        their crossings by phase, the phases in order, how many steps it takes (before a
        request finishes, and while the free blocks cover each step's crossings), and the
        memo of durations with the index of its first step; ``None`` when it is empty."""
        batch = self._pure_decodes()
        if batch is None:
            return None
        running, limit, context, crossings = batch
        seqs, size = len(running), self._kv.block_size
        phases = sorted(crossings)
        # Blocks: every request crosses once per block_size steps, so a whole round of
        # phases needs seqs blocks. The run stops at the first crossing step whose needs the
        # free blocks left cannot all cover (the step that grow() would refuse).
        free = self._kv.pool.num_free
        rounds, left = divmod(free, seqs)
        for phase in phases:
            need = len(crossings[phase])
            if need > left:
                break
            left -= need
        else:  # pragma: no cover - the phases' needs sum to seqs > left
            raise AssertionError("the crossings do not add up to the running requests")
        steps = min(limit, rounds * size + phase)
        if steps <= 0:
            return None
        known, base = self._durations(seqs, context)
        have = len(known) - base
        if have < steps:
            known.extend(
                self._steps.decode_run_seconds(
                    seqs, context + have * seqs, steps - have, self._slowdown
                )
            )
        return running, crossings, phases, steps, known, base

    def _durations(self, seqs: int, context: int) -> tuple[list[float], int]:
        """The memo of decode-step durations for a run of ``seqs`` requests from ``context``,
        and the index in it of the run's first step (the memo grows as the run asks).

        A run is priced twice (``decode_run_end``, then ``run_decodes`` up to where someone
        looked), and a run cut short goes on later from further down the same list: each
        step's duration is a pure function of ``(seqs, context, slowdown)``, so it is
        computed once and read back, the same float.
        """
        memo_seqs, memo_context, memo_slowdown, known = self._run_durations
        offset = context - memo_context
        if (
            seqs == memo_seqs
            and self._slowdown == memo_slowdown
            and offset >= 0
            and offset % seqs == 0
            and offset // seqs <= len(known)
        ):
            return known, offset // seqs
        known = []
        self._run_durations = (seqs, context, self._slowdown, known)
        return known, 0

    def _pure_decodes(self) -> tuple[list[Request], int, int, dict[int, list[Request]]] | None:
        """The running requests when they are all decodes with nothing waiting, with: how many
        steps they can take before one finishes, ``C`` = Σ (computed + 1), and the requests
        that need a block at run step ``p``, ``p + block_size``, ... by ``p``, in running
        order. ``None`` when the next step is not a pure-decode step."""
        scheduler = self._scheduler
        running = scheduler.running
        if not running or scheduler.waiting or len(running) > scheduler.max_num_batched_tokens:
            return None  # (the budget test is a guard: admission already keeps n <= budget)
        size = self._kv.block_size
        limit = self._max_model_len  # more steps than any request can take
        context = 0
        crossings: dict[int, list[Request]] = {}
        for r in running:
            computed = r.num_computed_tokens
            if r.num_tokens - computed != 1 or not r.num_output_tokens:
                return None  # a prompt chunk is still to run
            limit = min(limit, r.target_output_tokens - r.num_output_tokens - 1)
            context += computed + 1
            phase = r.kv_checkpoint - computed - 1
            assert 0 <= phase < size, f"{r}: its table is not within a block of its tokens"
            crossings.setdefault(phase, []).append(r)
        return running, limit, context, crossings

    # -- observation --------------------------------------------------------------------

    def load(self) -> tuple[int, int, float]:
        """``(num_running, num_waiting, kv_cache_usage)``: what a scrape reads of
        :meth:`stats`, without building it."""
        scheduler = self._scheduler
        return len(scheduler.running), len(scheduler.waiting), self._kv.usage

    def stats(self) -> ReplicaStats:
        scheduler = self._scheduler
        return ReplicaStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_cache_usage=self._kv.usage,
            num_gpu_blocks=self._num_gpu_blocks,
            block_size=self._config.block_size,
            prefix_cache_queries=scheduler.prefix_cache_queries,
            prefix_cache_hits=scheduler.prefix_cache_hits,
            num_preemptions=scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            finished=dict(self._finished),
        )

    def take_kv_events(self) -> list[KvCacheEvent]:
        """What the prefix cache did since the last call, in order (``kv_events`` on; else
        always empty): the shell publishes them after each step."""
        return self._kv.take_events()

    def progress(self, request_id: str) -> Progress | None:
        """What ``request_id`` has generated so far and where its output goes on (a stream
        lost here is resumed elsewhere from it); ``None`` when it is unknown or finished."""
        state = self._requests.get(request_id)
        if state is None or state.pooling:
            return None
        filler, start, n = self._filler, state.output_offset, state.num_output_tokens
        return Progress(tuple(filler.token(start + i) for i in range(n)), start + n)

    @property
    def filler(self) -> FillerTokens:
        """The token sequence every generated text of this replica is a window of."""
        return self._filler

    def blocks_of(self, request_id: str) -> tuple[int, ...]:
        """The KV blocks ``request_id`` holds now (empty when waiting, finished or unknown)."""
        state = self._requests.get(request_id)
        return self._kv.blocks_of(state) if state is not None else ()

    def check_invariants(self) -> None:
        """``AssertionError`` unless queues, requests and the block pool agree (for tests)."""
        scheduler = self._scheduler
        self._kv.pool.check(self._kv.block_tables())
        running, waiting = scheduler.running, list(scheduler.waiting)
        assert len(running) <= self._config.max_num_seqs, "more running than max_num_seqs"
        assert {r.request_id for r in running} | {r.request_id for r in waiting} == set(
            self._requests
        ), "queues and the request table disagree"
        assert len(running) + len(waiting) == len(self._requests), "a request is queued twice"
        size = self._config.block_size
        for r in running:
            assert r.status is RequestStatus.RUNNING, f"{r} in running"
            assert 0 <= r.num_computed_tokens <= r.num_tokens, f"{r}: computed beyond tokens"
            assert len(self._kv.blocks_of(r)) * size >= r.num_computed_tokens, f"{r}: no slots"
        for r in waiting:
            assert r.status is RequestStatus.WAITING, f"{r} in waiting"
            assert r.num_computed_tokens == 0, f"{r} has computed tokens"
            assert not self._kv.blocks_of(r), f"{r} holds KV blocks"
        for r in self._requests.values():
            assert r.num_tokens == r.num_prompt_tokens + r.num_output_tokens, f"{r}: token count"
            if r.pooling:
                assert r.num_output_tokens == r.target_output_tokens == 0, f"{r}: output"
            else:
                assert r.num_output_tokens < r.target_output_tokens <= r.max_tokens, f"{r}: output"
        assert 0.0 <= self._kv.usage <= 1.0, "KV usage outside [0, 1]"

    # -- validation ---------------------------------------------------------------------

    def _validate(self, request: NewRequest) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already running or waiting")
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError("the prompt is empty: at least one prompt token is required")
        if request.pooling:
            if len(prompt) > self._max_model_len:
                raise ValueError(
                    f"This model's maximum context length is {self._max_model_len} tokens. "
                    f"However, you requested {len(prompt)} tokens in the input for embedding "
                    "generation. Please reduce the length of the input."
                )
        else:
            if request.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {request.max_tokens}")
            total = len(prompt) + request.max_tokens
            if total > self._max_model_len:
                raise ValueError(
                    f"This model's maximum context length is {self._max_model_len} tokens. "
                    f"However, you requested {total} tokens ({len(prompt)} in the messages, "
                    f"{request.max_tokens} in the completion). Please reduce the length of the "
                    "messages or completion."
                )
        vocab = self._config.model.vocab_size
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is out of vocabulary (vocab size {vocab})")


def _memory_plan(config: ReplicaConfig) -> MemoryPlan:
    limits = EngineLimits(
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        block_size=config.block_size,
    )
    return memory_plan(
        config.model,
        config.gpu,
        parallel=Parallelism(tp=config.tp, pp=config.pp),
        weights_dtype=config.weights_dtype,
        kv_dtype=config.kv_dtype,
        limits=limits,
    )


def _num_gpu_blocks(config: ReplicaConfig) -> int:
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    plan = _memory_plan(config)
    if plan.kv_blocks < 1:
        raise ValueError(
            f"{config.model.name} does not fit on {config.tp * config.pp} x {config.gpu.name} "
            f"at gpu_memory_utilization={config.gpu_memory_utilization}: no memory is left "
            "for the KV cache"
        )
    return plan.kv_blocks


def _max_model_len(config: ReplicaConfig, num_gpu_blocks: int) -> int:
    capacity = num_gpu_blocks * config.block_size
    limit = config.max_model_len
    if limit is None:
        return min(config.model.max_context, capacity)
    if limit > config.model.max_context:
        raise ValueError(
            f"max_model_len={limit} is larger than {config.model.name}'s maximum context "
            f"length of {config.model.max_context} tokens"
        )
    if limit > capacity:
        raise ValueError(
            f"max_model_len={limit} is larger than the {capacity} tokens the KV cache can hold "
            f"({num_gpu_blocks} blocks of {config.block_size}); lower max_model_len or raise "
            "gpu_memory_utilization"
        )
    return limit
