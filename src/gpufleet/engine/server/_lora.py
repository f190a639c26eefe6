"""LoRA adapters on the sim engine, served as vLLM serves them (``--enable-lora``).

::

    --lora-modules sql=/adapters/sql                  registered (and loaded) at start
    POST /v1/load_lora_adapter   {"lora_name": "chat", "lora_path": "/adapters/chat"}
    POST /v1/unload_lora_adapter {"lora_name": "chat"}
    POST /v1/completions         {"model": "sql", ...}     the base model answers, as "sql"

(the two routes only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: ``_lora_routes.py``). vLLM
keeps adapters in caches; this module models them in the server layer, before a request is
submitted, so the replica model's step loop never hears of an adapter:

* **registered** adapters (``GET /v1/models`` lists them after the base model) are
  unbounded;
* at most ``max_cpu_loras`` are **resident** (loaded), least recently used first out: a load
  evicts the least recently used resident adapter that has no request in the model (vLLM's
  LRU cache of loaded adapters);
* at most ``max_loras`` adapters have requests **in the model** at once (vLLM's scheduler
  schedules no request of another adapter while ``max_loras`` are in its batch): a request
  for another adapter waits for one to have none left before it is submitted;
* a request for an adapter that is not resident waits its **load** before it is submitted,
  one load shared by every request that needs it. A load takes
  ``gpufleet.perf.lora_load_seconds(model, gpu, rank=r)`` on the engine's clock (~0.104 s
  for a rank-8 adapter of llama-3.1-8b on an H100), an unload ``UNLOAD_S``; the waits
  count in the request's modelled TTFT and e2e latency, and the waiting requests in
  ``vllm:num_requests_waiting``.

A request under an adapter's name is then served by the base model, at the base model's
speed: vLLM's LoRA compute per step (the adapter matmuls of every batch that has one) is
**not modelled**, nor is the prefix cache kept apart per adapter (vLLM's block hashes include
the adapter; here a prompt shares cached blocks with the base model's), nor the stall of the
whole batch while vLLM loads an adapter inside a step (here only that adapter's requests
wait). A tensor-parallel replica loads as one GPU would.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.engine.server._clock import Clock
from gpufleet.engine.server._config import LoraModuleConfig
from gpufleet.engine.server._errors import (
    InvalidUserInputError,
    LoraLoadError,
    NotFoundError,
)
from gpufleet.engine.server._metrics import LoraSnapshot, ShellCounts
from gpufleet.perf import UNLOAD_S

logger = logging.getLogger("gpufleet.engine.sim")

RequestState = Callable[[str], bool | None]
"""A submitted request's state in the model: ``True`` running, ``False`` waiting, ``None``
finished (or unknown)."""


def adapter_rank(path: str, default: int) -> int:
    """An adapter's rank, as vLLM reads it: ``r`` of ``<path>/adapter_config.json`` (the
    highest of ``r`` and its ``rank_pattern``) when the path is a directory that has one.

    Otherwise ``default`` (the engine's ``max_lora_rank``): the sim engine loads no weights,
    so a path it cannot read — a Hugging Face id, a directory on another machine — is taken
    for an adapter of the highest rank it accepts. A config that is there but names no
    integer rank is a ``LoraLoadError``, as vLLM's load fails on it.
    """
    config = Path(path) / "adapter_config.json"
    try:
        text = config.read_text(encoding="utf-8")
    except (OSError, ValueError):  # no such file, not a directory, a NUL in the path
        return default
    ranks: list[object]
    try:
        data = json.loads(text)
        ranks = [data["r"], *data.get("rank_pattern", {}).values()]
    except (ValueError, KeyError, TypeError, AttributeError):
        ranks = []
    valid = [r for r in ranks if isinstance(r, int) and not isinstance(r, bool) and r >= 1]
    if ranks and len(valid) == len(ranks):
        return max(valid)
    raise LoraLoadError(
        f"Call to add_lora method failed: {config} is not a LoRA config with an integer rank r"
    )


@dataclass(eq=False, slots=True)
class Adapter:
    """One registered adapter and the requests that use it now."""

    name: str
    path: str
    rank: int
    base_model_name: str | None = None
    requests: dict[str, bool] = field(default_factory=dict)
    """Its model requests between ``acquire`` and ``release``: id → submitted to the model."""
    queued: int = 0
    """Its requests waiting for a slot (``max_loras``), not yet in ``requests``."""
    loading: asyncio.Task[None] | None = None
    """Its load in progress, shared by whoever needs it."""
    dropped: bool = False
    """Unloaded: a load that ends after it does not make it resident."""


class LoraAdapters:
    """The registered adapters, the resident ones, the slots and the loads (module docstring).

    ``load_seconds(rank)`` is the modelled time of a load; ``state`` tells a submitted
    request's state in the model (for ``vllm:lora_requests_info``); ``shell.lora_held``
    counts the requests not yet submitted.
    """

    def __init__(
        self,
        *,
        max_loras: int,
        max_cpu_loras: int,
        max_lora_rank: int,
        load_seconds: Callable[[int], float],
        clock: Clock,
        shell: ShellCounts,
        state: RequestState,
    ) -> None:
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_lora_rank = max_lora_rank
        self.registered: dict[str, Adapter] = {}
        """Every adapter a request may name, in the order they were registered."""
        self.loads = 0
        self.unloads = 0
        self.evictions = 0
        self._load_seconds = load_seconds
        self._clock = clock
        self._shell = shell
        self._state = state
        self._resident: OrderedDict[str, Adapter] = OrderedDict()
        """Loaded adapters, least recently used first."""
        self._loading: set[Adapter] = set()
        self._active: set[Adapter] = set()
        """Adapters with requests in ``requests`` (the ``max_loras`` slots)."""
        self._tracked: dict[Adapter, None] = {}
        """Adapters with requests queued or in ``requests`` (what a scrape reads)."""
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        """One load or unload of a name at a time, as vLLM's per-name lock."""

    # -- registration -------------------------------------------------------------------

    def register_at_start(self, modules: Iterable[LoraModuleConfig]) -> None:
        """``--lora-modules``, in order: each registered and loaded at once (the start of an
        engine is not modelled), later ones evicting earlier ones past ``max_cpu_loras``.
        An adapter above ``max_lora_rank`` is a ``ValueError``: vLLM does not start."""
        for module in modules:
            rank = adapter_rank(module.path, self.max_lora_rank)
            if rank > self.max_lora_rank:
                raise ValueError(self._rank_message(rank))
            adapter = Adapter(module.name, module.path, rank, module.base_model_name)
            self.registered[module.name] = adapter
            self._resident[module.name] = adapter
            self._settle(count=False)

    async def load(self, name: str, path: str, *, inplace: bool = False) -> None:
        """``POST /v1/load_lora_adapter``: check, load (modelled time), then register."""
        if not name or not path:
            raise InvalidUserInputError("Both 'lora_name' and 'lora_path' must be provided.")
        async with self._locks[name]:
            existing = self.registered.get(name)
            if existing is not None and not inplace:
                raise InvalidUserInputError(
                    f"The lora adapter '{name}' has already been loaded. If you want to load "
                    "the adapter in place, set 'load_inplace' to True."
                )
            rank = adapter_rank(path, self.max_lora_rank)
            if rank > self.max_lora_rank:
                raise LoraLoadError(self._rank_message(rank))
            if existing is None:
                adapter = Adapter(name, path, rank)
            else:  # in place: the same adapter, its new weights loaded again
                adapter = existing
                adapter.path, adapter.rank = path, rank
                if self._resident.get(name) is adapter:
                    del self._resident[name]
            await self._ensure_resident(adapter)
            self.registered[name] = adapter
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)

    async def unload(self, name: str) -> None:
        """``POST /v1/unload_lora_adapter``: its requests in flight finish; new ones are 404."""
        if not name:
            raise InvalidUserInputError(
                "'lora_name' needs to be provided to unload a LoRA adapter."
            )
        async with self._locks[name]:
            adapter = self.registered.get(name)
            if adapter is None:
                raise NotFoundError(f"The lora adapter '{name}' cannot be found.")
            await self._wait(UNLOAD_S)
            del self.registered[name]
            adapter.dropped = True
            if self._resident.get(name) is adapter:
                del self._resident[name]
            self.unloads += 1
        logger.info("Removed LoRA adapter: name '%s'", name)

    def resident(self) -> tuple[str, ...]:
        """The loaded adapters, least recently used first."""
        return tuple(self._resident)

    # -- requests -----------------------------------------------------------------------

    async def acquire(self, adapter: Adapter, request_ids: Sequence[str]) -> None:
        """Wait for a slot, then for the adapter to be resident; the requests are then the
        caller's to submit (``submitted``) and to ``release``, whatever happens. If this
        raises (the client went away), nothing is left to release."""
        count = len(request_ids)
        self._shell.lora_held += count
        adapter.queued += count
        self._tracked[adapter] = None
        try:
            while not (adapter in self._active or len(self._active) < self.max_loras):
                waiter = asyncio.get_running_loop().create_future()
                self._slot_waiters.append(waiter)
                try:
                    await waiter
                finally:
                    if not waiter.done():
                        self._slot_waiters.remove(waiter)
        except BaseException:
            adapter.queued -= count
            self._shell.lora_held -= count
            self._untrack(adapter)
            raise
        adapter.queued -= count
        adapter.requests.update(dict.fromkeys(request_ids, False))
        self._active.add(adapter)
        try:
            await self._ensure_resident(adapter)
        except BaseException:
            self.release(adapter, request_ids)
            raise

    def submitted(self, adapter: Adapter, request_ids: Sequence[str]) -> None:
        """The requests are in the model now."""
        for request_id in request_ids:
            adapter.requests[request_id] = True
        self._shell.lora_held -= len(request_ids)

    def release(self, adapter: Adapter, request_ids: Sequence[str]) -> None:
        """The requests are done (finished, aborted, refused): their slot may free."""
        for request_id in request_ids:
            submitted = adapter.requests.pop(request_id, None)
            if submitted is False:
                self._shell.lora_held -= 1
        if adapter.requests:
            return
        if adapter in self._active:
            self._active.discard(adapter)
            waiters, self._slot_waiters = self._slot_waiters, deque()
            for waiter in waiters:  # each looks again, in the order they came
                if not waiter.done():
                    waiter.set_result(None)
        self._untrack(adapter)

    def snapshot(self) -> LoraSnapshot:
        """What ``vllm:lora_requests_info`` and the counters show now."""
        running: set[str] = set()
        waiting: set[str] = set()
        for adapter in self._tracked:
            if adapter.queued:
                waiting.add(adapter.name)
            for request_id, submitted in adapter.requests.items():
                state = self._state(request_id) if submitted else False
                if state is True:
                    running.add(adapter.name)
                elif state is False:
                    waiting.add(adapter.name)
        return LoraSnapshot(
            tuple(sorted(running)),
            tuple(sorted(waiting)),
            self.loads,
            self.unloads,
            self.evictions,
        )

    # -- the cache ----------------------------------------------------------------------

    async def _ensure_resident(self, adapter: Adapter) -> None:
        if self._resident.get(adapter.name) is adapter:
            self._resident.move_to_end(adapter.name)
            return
        if adapter.loading is None:
            adapter.loading = asyncio.create_task(self._load(adapter))
        # shielded: a client that goes away does not stop the load the others wait for
        await asyncio.shield(adapter.loading)

    async def _load(self, adapter: Adapter) -> None:
        self._loading.add(adapter)
        try:
            self._settle(count=True)  # make room first, as vLLM does
            await self._wait(self._load_seconds(adapter.rank))
        finally:
            self._loading.discard(adapter)
            adapter.loading = None
        self.loads += 1
        if not adapter.dropped:
            self._resident.pop(adapter.name, None)
            self._resident[adapter.name] = adapter
            self._settle(count=True)

    def _settle(self, *, count: bool) -> None:
        """Evict least recently used adapters with no request in the model until the loaded
        and loading ones fit ``max_cpu_loras``; an adapter in use is never evicted (past the
        cap only while loads overlap, or when every other one is in use)."""
        while len(self._resident) + len(self._loading) > self.max_cpu_loras:
            victim = next((a for a in self._resident.values() if a not in self._active), None)
            if victim is None:
                return
            del self._resident[victim.name]
            if count:
                self.evictions += 1

    def _untrack(self, adapter: Adapter) -> None:
        if not adapter.queued and not adapter.requests:
            self._tracked.pop(adapter, None)

    def _rank_message(self, rank: int) -> str:
        return (
            "Call to add_lora method failed: LoRA rank "
            f"{rank} is greater than max_lora_rank {self.max_lora_rank}."
        )

    async def _wait(self, seconds: float) -> None:
        clock = self._clock
        await clock.sleep_until(clock.now() + seconds)
