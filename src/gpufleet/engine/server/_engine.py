"""One sim replica's state, shared by every route: model, loop, tokenizer, metrics and faults."""

from __future__ import annotations

import random
import secrets
import socket
import time
from collections.abc import Iterable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

from gpufleet.catalog import GPUSpec, ModelSpec
from gpufleet.engine._tokenizer import Tokenizer
from gpufleet.engine.model import NewRequest, ReplicaModel
from gpufleet.engine.server._clock import Clock
from gpufleet.engine.server._config import SimEngineConfig
from gpufleet.engine.server._dcgm import DcgmCollector
from gpufleet.engine.server._errors import (
    BadRequestError,
    EngineUnavailableError,
    NotFoundError,
    PromptTooLongError,
)
from gpufleet.engine.server._faults import Faults
from gpufleet.engine.server._kv_publish import KvEventPublisher
from gpufleet.engine.server._loop import EngineDeadError, EngineLoop, RequestStream
from gpufleet.engine.server._lora import Adapter, LoraAdapters
from gpufleet.engine.server._metrics import EngineMetrics, LoraMetrics
from gpufleet.engine.server._sleep import SleepMetrics, SleepMode
from gpufleet.perf import Parallelism, lora_load_seconds, residency_times

if TYPE_CHECKING:  # imported where tracing is on (the `tracing` extra)
    from gpufleet.engine.server._tracing import EngineTracing

Scope = MutableMapping[str, Any]


def _tracing(endpoint: str, name: str) -> EngineTracing:
    try:
        from gpufleet.engine.server._tracing import EngineTracing  # noqa: PLC0415 - on demand
    except ImportError as error:
        raise ValueError(
            f"--otlp-traces-endpoint needs OpenTelemetry ({error.name} is missing): "
            "pip install 'gpufleet[tracing]'"
        ) from None
    return EngineTracing(endpoint, f"sim-engine {name}")


class SimEngine:
    """Everything one sim replica holds: model, loop, tokenizer, metrics and faults."""

    def __init__(self, config: SimEngineConfig, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        replica = config.replica_config()
        spec = replica.model
        self.model = ReplicaModel(replica)
        self.model.set_slowdown(config.faults.slowdown)
        self.tokenizer = Tokenizer(spec.vocab_size)
        self.hidden_size = spec.hidden_size
        self.name = config.name
        self.max_model_len = self.model.max_model_len
        stats = self.model.stats()
        self.metrics = EngineMetrics(
            self.name,
            self.model.stats,
            {
                "block_size": str(stats.block_size),
                "num_gpu_blocks": str(stats.num_gpu_blocks),
                "num_cpu_blocks": "0",
                "cache_dtype": "auto",
                "enable_prefix_caching": str(config.enable_prefix_caching),
                "gpu_memory_utilization": str(config.gpu_memory_utilization),
            },
        )
        self.kv_events: KvEventPublisher | None = None
        """The KV-event publisher (``--kv-events-config``), or ``None``."""
        if replica.kv_events:
            self.kv_events = KvEventPublisher(config.kv_events)
        publish = None if self.kv_events is None else self.kv_events.publish
        self.tracing: EngineTracing | None = None
        """Spans of its requests (``--otlp-traces-endpoint``), or ``None``."""
        if config.otlp_traces_endpoint is not None:
            self.tracing = _tracing(config.otlp_traces_endpoint, self.name)
        self.loop = EngineLoop(self.model, clock, self.metrics, publish=publish)
        hostname = socket.gethostname()
        self.gpus = DcgmCollector(self.model, self.metrics.activity, clock.now, hostname)
        """dcgm-exporter's gauges for the replica's GPUs, modelled (``DCGM_FI_*``)."""
        self.metrics.registry.register(self.gpus)
        self.faults = Faults(config.faults, random.Random(config.seed))
        times = residency_times(
            spec, replica.gpu, parallel=Parallelism(tp=replica.tp, pp=replica.pp)
        )
        self.sleep = SleepMode(times, clock, self.loop)
        """vLLM's sleep mode (``_sleep.py``); its routes only with ``dev_mode``."""
        self.metrics.registry.register(SleepMetrics(self.sleep, (self.name, "0")))
        self.lora: LoraAdapters | None = None
        """The LoRA adapters (``--enable-lora``; ``_lora.py``), or ``None``."""
        self._lora_owner: dict[str, Adapter] = {}
        """The adapter of each request ``submit_lora`` queued, until ``release_lora``."""
        if config.enable_lora:
            self.lora = self._adapters(spec, replica.gpu)
        self._next_request = 0
        self.created = int(time.time())

    def _adapters(self, spec: ModelSpec, gpu: GPUSpec) -> LoraAdapters:
        config, model = self.config, self.model

        def state(request_id: str) -> bool | None:
            if model.blocks_of(request_id):
                return True
            return False if self.loop.serving(request_id) else None

        lora = LoraAdapters(
            max_loras=config.max_loras,
            max_cpu_loras=config.cpu_loras,
            max_lora_rank=config.max_lora_rank,
            load_seconds=lambda rank: lora_load_seconds(spec, gpu, rank=rank),
            clock=self.clock,
            shell=self.metrics.shell,
            state=state,
        )
        lora.register_at_start(config.lora_modules)
        metrics = LoraMetrics(config.max_loras, lora.snapshot, (self.name, "0"))
        self.metrics.registry.register(metrics)
        return lora

    def new_request_id(self) -> str:
        """The model's id for a request: unique in this process, deterministic per seed."""
        self._next_request += 1
        return str(self._next_request)

    def response_id(self, prefix: str, scope: Scope) -> str:
        """``prefix-<X-Request-Id>`` when the client sent one (as vLLM does), else random, as
        vLLM's are: not drawn from ``--seed``, which every replica of a fleet shares, so two
        replicas never answer with the same id."""
        for key, value in scope["headers"]:
            if key == b"x-request-id" and value:
                return f"{prefix}-{value.decode('latin-1')}"
        return f"{prefix}-{self.random_hex()}"

    @staticmethod
    def random_hex() -> str:
        """128 random bits, as 32 hex digits."""
        return secrets.token_hex(16)

    def submit(self, requests: Iterable[NewRequest]) -> list[RequestStream]:
        """Queue requests in the model, all or none; their streams, in order.

        The model's refusal (a prompt too long, a bad token id) becomes a
        ``PromptTooLongError`` and a stopped loop an ``EngineUnavailableError``; the requests
        already queued are aborted first. A ``priority`` other than 0 under the ``fcfs``
        policy is a ``BadRequestError``.
        """
        requests = list(requests)
        if self.config.scheduling_policy == "fcfs":
            for new in requests:
                if new.priority:  # vLLM's engine refuses it before it queues anything
                    raise BadRequestError(
                        f"Got priority {new.priority} but Priority scheduling is not enabled "
                        "(start the engine with --scheduling-policy priority).",
                        param="priority",
                    )
        streams: list[RequestStream] = []
        try:
            for new in requests:
                streams.append(self.loop.submit(new))
        except (ValueError, EngineDeadError) as error:
            for stream in streams:
                self.loop.abort(stream.request_id)
            if isinstance(error, EngineDeadError):
                raise EngineUnavailableError(str(error)) from None
            raise PromptTooLongError(str(error)) from None
        return streams

    async def submit_as(
        self, adapter: str | None, requests: Sequence[NewRequest]
    ) -> list[RequestStream]:
        """``submit`` for the base model (``adapter`` is ``None``), else ``submit_lora``."""
        if adapter is None:
            return self.submit(requests)
        return await self.submit_lora(adapter, requests)

    async def submit_lora(self, name: str, requests: Sequence[NewRequest]) -> list[RequestStream]:
        """``submit`` for requests under adapter ``name``: they wait for a slot and for the
        adapter's load first (``_lora.py``), and that wait counts in their latencies (their
        streams' arrival is when this was called). The caller then owes
        ``release_lora(streams)`` once they are done; if this raises, nothing is owed."""
        lora = self.lora
        adapter = None if lora is None else lora.registered.get(name)
        if lora is None or adapter is None:  # unloaded since the request was accepted
            raise NotFoundError(f"The model `{name}` does not exist.", param="model")
        arrival = self.clock.now()
        ids = [request.request_id for request in requests]
        await lora.acquire(adapter, ids)
        try:
            streams = self.submit(requests)
        except BaseException:
            lora.release(adapter, ids)
            raise
        lora.submitted(adapter, ids)
        for stream in streams:
            stream.arrival = arrival
        self._lora_owner.update(dict.fromkeys(ids, adapter))
        return streams

    def release_lora(self, streams: Iterable[RequestStream]) -> None:
        """The requests ``submit_lora`` queued are done: their adapter's slot may free (any
        other stream: nothing to do)."""
        lora = self.lora
        if lora is None or not self._lora_owner:
            return
        for stream in streams:
            adapter = self._lora_owner.pop(stream.request_id, None)
            if adapter is not None:
                lora.release(adapter, [stream.request_id])

    def set_faults(self, patch: dict[str, Any]) -> dict[str, Any]:
        config = self.faults.update(patch)
        self.model.set_slowdown(config.slowdown)
        return config.model_dump()
