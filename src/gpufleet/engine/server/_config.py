"""The sim engine's settings: every default written down once, validated by pydantic."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpufleet.catalog import get_gpu, get_model
from gpufleet.engine.model import ReplicaConfig


class FaultConfig(BaseModel):
    """Faults a sim engine injects, for the tests of the layers above it.

    Set at start-up (``--fault-*`` flags) and at run time by ``POST /admin/faults`` with a
    JSON object of the fields to change (the endpoint exists only with ``--enable-admin``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    crash_after_s: float | None = Field(default=None, ge=0)
    """Exit the process (status 1, no cleanup) this many real seconds after it is set."""
    hang: bool = False
    """Accept every request except ``/admin/*`` and never answer it."""
    slowdown: float = Field(default=1.0, gt=0, le=1000)
    """Multiply every modelled step time by this factor."""
    error_rate: float = Field(default=0.0, ge=0, le=1)
    """Share of the requests that run the model (completions, embeddings, responses) answered
    with an error (``error_status``), drawn from the seeded RNG."""
    error_status: Literal[500, 503] = 500
    """The status of those errors: 500 (an engine fault) or 503 (overloaded)."""
    unhealthy: bool = False
    """``GET /health`` answers 503."""


class KvEventsConfig(BaseModel):
    """vLLM's ``KVEventsConfig``, the fields the sim engine reads (same names, defaults)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    """``None``: ``zmq`` when events are enabled, else ``null`` (as vLLM)."""
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = Field(10_000, ge=1)
    hwm: int = Field(100_000, ge=0)
    max_queue_size: int = Field(100_000, ge=1)
    """Accepted for vLLM's sake; the sim engine publishes in the loop, with no queue."""
    topic: str = ""

    @model_validator(mode="after")
    def _publisher(self) -> KvEventsConfig:
        if self.publisher is None:
            chosen = "zmq" if self.enable_kv_cache_events else "null"
            object.__setattr__(self, "publisher", chosen)
        return self

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


MaxLoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
"""The values vLLM's ``--max-lora-rank`` takes (its ``MaxLoRARanks``)."""


def runtime_lora_updating() -> bool:
    """vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, read from the environment as vLLM reads it
    (``1`` or ``true``, any case)."""
    value = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
    return value.strip().lower() in ("1", "true")


class LoraModuleConfig(BaseModel):
    """One adapter registered at start (``--lora-modules``; vLLM's ``LoRAModulePath``). Read
    from a dict or from anything with these attributes (the replica profile's ``LoraModule``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", from_attributes=True)

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    base_model_name: str | None = None


class SimEngineConfig(BaseModel):
    """One sim replica: the modelled model and GPU, vLLM's engine settings, clock and faults."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = "llama-3.1-8b"
    """Catalog model name or a Hugging Face ``config.json`` path."""
    gpu: str = "h100-sxm"
    """Catalog GPU name."""
    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    served_model_name: str | None = None
    """The name clients send in ``model`` (default: ``model``)."""
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    max_model_len: int | None = Field(default=None, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    block_size: int = Field(default=16, ge=1)
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = Field(default=None, ge=1)
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """vLLM's ``--scheduling-policy``: under ``priority`` a request's ``priority`` (lower
    first) orders the waiting queue and picks whom a full KV cache preempts; under ``fcfs`` a
    request that names a priority other than 0 is refused (400), as vLLM refuses it."""
    time_scale: float = Field(default=1.0, gt=0)
    """Modelled seconds per real second; reported latencies are always modelled."""
    seed: int = 0
    faults: FaultConfig = FaultConfig()
    enable_admin: bool = False
    """Serve ``/admin/faults``; off by default so that no client can inject faults."""
    enable_sleep_mode: bool = False
    """vLLM's ``--enable-sleep-mode``: the engine may be put to sleep and woken up."""
    dev_mode: bool = False
    """vLLM's ``VLLM_SERVER_DEV_MODE=1``: serve the development endpoints (``/sleep``,
    ``/wake_up``, ``/is_sleeping``); the CLI reads it from the environment, as vLLM does."""
    kv_events: KvEventsConfig = KvEventsConfig()
    """``--kv-events-config``: publish the prefix cache's KV events as vLLM does."""
    otlp_traces_endpoint: str | None = None
    """vLLM's ``--otlp-traces-endpoint`` (here OTLP/HTTP): an ``llm_request`` span per
    request, the child of the caller's ``traceparent`` (docs/tracing.md)."""
    enable_lora: bool = False
    """vLLM's ``--enable-lora``: serve LoRA adapters under their own names (``_lora.py``)."""
    max_loras: int = Field(default=1, ge=1)
    """vLLM's ``--max-loras``: the most adapters whose requests are in the model at once."""
    max_lora_rank: MaxLoraRank = 16
    """vLLM's ``--max-lora-rank``: an adapter of a higher rank is refused."""
    max_cpu_loras: int | None = Field(default=None, ge=1)
    """vLLM's ``--max-cpu-loras``: the most adapters kept loaded (``None``: ``max_loras``)."""
    lora_modules: tuple[LoraModuleConfig, ...] = ()
    """vLLM's ``--lora-modules``: adapters registered (and loaded, in order) at start."""
    allow_runtime_lora_updating: bool = Field(default_factory=runtime_lora_updating)
    """vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: serve ``POST /v1/load_lora_adapter`` and
    ``/v1/unload_lora_adapter`` (404 otherwise). Default: the environment's, as vLLM reads it
    when its server starts."""

    @model_validator(mode="after")
    def _lora(self) -> SimEngineConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        names = [module.name for module in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules: an adapter name is given twice: {names}")
        return self

    @property
    def name(self) -> str:
        """The served model name."""
        return self.served_model_name or self.model

    @property
    def cpu_loras(self) -> int:
        """The adapters kept loaded: ``max_cpu_loras``, or ``max_loras`` (vLLM's default)."""
        return self.max_cpu_loras or self.max_loras

    def replica_config(self) -> ReplicaConfig:
        """The replica model this engine runs (an unknown model or GPU: ``CatalogError``)."""
        return ReplicaConfig(
            model=get_model(self.model),
            gpu=get_gpu(self.gpu),
            tp=self.tp,
            pp=self.pp,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            scheduling_policy=self.scheduling_policy,
            seed=self.seed,
            kv_events=self.kv_events.enabled and self.enable_prefix_caching,
        )
