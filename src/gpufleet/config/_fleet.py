"""The fleet file: what ``gpufleet up`` runs and how the gateway serves it.

One YAML file, validated by the pydantic models below; every default is written here::

    gateway: {host: 127.0.0.1, port: 8000}
    models:
      - name: llama-3.1-8b          # what clients send as `model`; also the pool's name
        engine: sim                  # sim | vllm | external
        gpu: h100-sxm
        replicas: 2
        routing: prefix_aware        # or {policy: kv_aware, kv_weight: 4}
        health: {outlier: {consecutive_5xx: 3}}
    runtime: local                   # or kubernetes, or {kind: kubernetes, namespace: …}
    served:                          # optional: names over pools (a pool not listed as a
      - name: llama                  #   variant is served under its own name)
        variants: {llama-3.1-8b: 80, llama-3.1-8b-v2: 20}
        fallbacks: [llama-3.1-70b]   # on 5xx, overload, or a prompt past the context

``load_fleet(path)`` reads and validates a file; a bad one is a :class:`FleetFileError` (a
``ValueError``) whose message names the file and the field path (``models[0].gpu: …``).
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import replace
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import pydantic
import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from gpufleet.catalog import CatalogError, get_gpu, get_model
from gpufleet.config._reclaim import ReclaimConfig, node_label
from gpufleet.config._residency import DEFAULT_MEMORY, check_slots
from gpufleet.fleet import ReplicaProfile
from gpufleet.policy import (
    AdmissionConfig,
    AutoscaleConfig,
    HealthConfig,
    LoraConfig,
    PrefixAwareConfig,
    ResidencyConfig,
    RolloutConfig,
    RouterConfig,
    SpareConfig,
)

_NAME: Final = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?")
"""A model's name names its pool and replicas (``llama-3.1-8b-0``) and their log files."""
_NAMESPACE: Final = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_SERVED_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}")
"""A served name is only ever compared (what clients send as ``model``): Hugging Face ids
(``meta-llama/Llama-3.1-8B-Instruct``) and tags (``chat:latest``) are fine."""


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EngineKind(StrEnum):
    """How a model's replicas run (the runtime's kinds, by the same names)."""

    SIM = "sim"
    """``gpufleet engine sim`` child processes: modelled vLLM replicas."""
    VLLM = "vllm"
    """vLLM's OpenAI server as child processes (a GPU, or vLLM's CPU build: docs/engines.md)."""
    EXTERNAL = "external"
    """Endpoints someone else runs: nothing is started, ``endpoints`` are routed to."""


class StartupConfig(_Strict):
    """How long a new replica takes to serve: what the simulator models and what
    ``gpufleet up`` emulates (seeds: 3–10 min to provision a GPU, 30 s–3 min to load a model).
    """

    provision: float = Field(0.0, ge=0.0)
    """Seconds before a cold replica's engine starts (a cloud VM or a node joining). Live,
    the runtime waits this long before it spawns the process; a crash restart does not."""
    load: float = Field(60.0, ge=0.0)
    """Seconds the engine takes to load the model and become ready (simulated; live, the
    engine takes what it takes)."""
    promote: float = Field(5.0, ge=0.0)
    """Seconds a prewarmed standby takes to join the routable pool."""
    timeout: float | None = Field(None, gt=0.0)
    """The startup budget, live: seconds a launched engine has to answer ``/health`` before
    the runtime kills it and starts it again (a crash, with backoff). Separate from the
    health checks of a serving replica. Default: ``STARTUP_TIMEOUTS`` of the engine kind
    (a real engine downloads, loads and compiles a model: minutes)."""

    @property
    def cold(self) -> float:
        """A cold start: provisioning + model load."""
        return self.provision + self.load


STARTUP_TIMEOUTS: Final = {
    EngineKind.SIM: 120.0,
    EngineKind.VLLM: 1800.0,
    EngineKind.EXTERNAL: 120.0,
}
"""Default ``startup.timeout`` per engine kind, in seconds."""


SPOT_DISCOUNT: Final = 0.7
"""A spot GPU's discount on its on-demand price when the fleet file names no spot price:
providers' spot capacity is typically 60-90 % cheaper, 70 % being the figure a fleet plan
quotes (docs/spot.md)."""


class Capacity(StrEnum):
    """What a pool's GPUs are bought as."""

    ON_DEMAND = "on_demand"
    SPOT = "spot"
    """Cheaper, and the provider may take it back after a short notice (a preemption)."""


class SpotFallback(StrEnum):
    """What replaces a reclaimed spot replica when the provider has no spot GPUs left."""

    WAIT = "wait"
    """Nothing until spot GPUs are back: the pool serves with fewer replicas meanwhile."""
    ON_DEMAND = "on_demand"
    """An on-demand replica stands in, at the on-demand price, until spot GPUs are back;
    then a spot replica takes its place."""


class SpotConfig(_Strict):
    """A spot pool's price, and what the controller does with a preemption notice
    (docs/spot.md)."""

    usd_per_gpu_hour: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    """The spot price per GPU-hour; ``None``: the catalog's on-demand price less
    ``SPOT_DISCOUNT``."""
    abandon_before: float = Field(5.0, ge=0.0, allow_inf_nan=False)
    """Seconds before a noticed replica is taken at which the attempts still on it are
    ended: a stream resumes elsewhere with what it had, a whole answer is sent again. Until
    then they run on (most finish within a notice of 30-120 s); the replica takes no new
    attempt from the notice on."""
    interactive: bool = False
    """Whether interactive requests may go to this pool when it is a variant of a served
    name: by default a served name sends its ``batch`` class to its spot variants and its
    other classes to the others (a pool named directly takes whatever it is sent)."""
    fallback: SpotFallback = SpotFallback.WAIT
    """A reclaimed replica's replacement when no spot GPU is to be had: ``wait`` for one,
    or stand in with ``on_demand`` capacity until spot is back (docs/spot.md)."""
    node_label: str = "karpenter.sh/capacity-type=spot"
    """The label of the cluster's spot nodes (``gpufleet deploy k8s``): the pool's pods
    require it (``fallback: wait``) or prefer it (``on_demand``). Karpenter's by default;
    GKE ``cloud.google.com/gke-spot=true``, EKS node groups
    ``eks.amazonaws.com/capacityType=SPOT``, AKS ``kubernetes.azure.com/scalesetpriority=spot``."""

    @field_validator("node_label")
    @classmethod
    def _node_label(cls, text: str) -> str:
        node_label(text)
        return text


def _existing_file(path: str) -> str:
    """A file read when ``gpufleet up`` starts must be there when the file is loaded: a typo
    is the fleet file's error, not the first TLS handshake's."""
    if not Path(path).is_file():
        why = "a directory, not a file" if Path(path).is_dir() else "no such file"
        raise ValueError(f"{path}: {why}")
    return path


ExistingFile = Annotated[str, AfterValidator(_existing_file)]
"""A path (relative ones to the working directory) that must name an existing file."""


def _residency_mode(value: object) -> object:
    return {"mode": value} if isinstance(value, str) else value


def _policy_name(value: object) -> object:
    return {"policy": value} if isinstance(value, str) else value


class ModelConfig(_Strict):
    """One served model: a pool of identical replicas behind one router."""

    name: str
    """What clients send as ``model``; also the pool's name and its replicas' prefix."""
    model: str | None = None
    """The catalog model a sim replica models, or the Hugging Face id vLLM serves
    (default: ``name``)."""
    engine: EngineKind = EngineKind.SIM
    gpu: str = "h100-sxm"
    """Catalog GPU name (sim and vllm)."""
    tp: int = Field(1, ge=1)
    """Tensor-parallel size."""
    replicas: int | None = Field(None, ge=0)
    """Replicas to run (default: 2, or one per endpoint for ``external``)."""
    gpu_memory_utilization: float | None = Field(None, gt=0.0, le=1.0)
    """Share of each GPU's memory the engine may take, weights and KV cache included
    (``--gpu-memory-utilization``; default: the engine's, 0.9)."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest context (prompt + output) served (``--max-model-len``; default: the model's,
    clamped by the engine to what its KV cache holds)."""
    prefix_caching: bool = True
    """Automatic prefix caching (``--enable-prefix-caching`` / ``--no-enable-prefix-caching``):
    what makes ``prefix_aware`` routing pay off."""
    args: tuple[str, ...] = ()
    """Extra engine flags (``["--max-num-seqs", "64"]``, ``["--time-scale", "10"]`` for a sim
    engine); a flag given here wins over the fields above. Read once, into :meth:`profile`."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment of the engine's processes (``CUDA_VISIBLE_DEVICES``,
    ``VLLM_CPU_KVCACHE_SPACE``, …)."""
    endpoints: tuple[str, ...] = ()
    """Base URLs (``http://host:port`` or ``https://host:port``, no ``/v1``) of an
    ``external`` model's replicas."""
    ca_file: ExistingFile | None = None
    """PEM CA bundle that verifies the certificates of this model's ``https://`` endpoints,
    instead of the system's trust store (a private CA). The gateway's requests, probes and
    scrapes, and the runtime's readiness probes, check the name in the URL against it."""
    routing: Annotated[RouterConfig, BeforeValidator(_policy_name)] = PrefixAwareConfig()
    """The router: a policy name, or a mapping with ``policy`` and its settings
    (docs/design/routing.md)."""
    health: HealthConfig = HealthConfig()
    """Outlier detection and active checks (docs/design/health.md)."""
    autoscale: AutoscaleConfig | None = None
    """Autoscaling of this pool (docs/design/autoscaling.md); ``None``: a fixed ``replicas``.
    With it, ``replicas`` is the count the pool starts with (default ``min_replicas``)."""
    startup: StartupConfig = StartupConfig()
    """Start-up times: simulated, and emulated live (``provision``)."""
    residency: Annotated[ResidencyConfig, BeforeValidator(_residency_mode)] = ResidencyConfig()
    """Whether the model stays on its GPUs (``always``) or sleeps and wakes on demand
    (``on_demand``), and which GPU slots it shares (docs/residency.md)."""
    capacity: Capacity = Capacity.ON_DEMAND
    """``spot``: GPUs the provider may take back after a notice; the controller drains a
    noticed replica (docs/spot.md)."""
    spot: SpotConfig | None = None
    """A spot pool's price and notice handling (``capacity: spot`` only; default
    :class:`SpotConfig`)."""
    lora: LoraConfig | None = None
    """LoRA adapters served on this pool's replicas, each under its own name, loaded on
    demand and placed by affinity (docs/residency.md, "LoRA adapters")."""
    fallbacks: tuple[str, ...] = ()
    """Served names to try next, in order, when this pool cannot answer (every attempt
    failed with a 5xx or a timeout, the pool shed the request or has no replica) or the
    prompt is longer than its context (:attr:`context_length`). For a pool served under its
    own name; a pool that is a ``served`` entry's variant takes that entry's ``fallbacks``."""

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if not _NAME.fullmatch(self.name):
            raise ValueError(
                f"name {self.name!r}: use lower-case letters, digits, '.' and '-' "
                "(it names the pool, its replicas and their log files)"
            )
        if self.spot is not None and self.capacity is not Capacity.SPOT:
            raise ValueError("spot: its settings are for a pool with `capacity: spot`")
        if self.engine is EngineKind.EXTERNAL:
            self._check_external()
            return self
        if self.endpoints:
            raise ValueError(f"endpoints are for external models, not {self.engine.value!r}")
        if self.ca_file is not None:
            raise ValueError(
                f"ca_file is for an external model's https:// endpoints, not {self.engine.value!r}"
            )
        if self.residency.slots is not None and self.autoscale is not None:
            raise ValueError(
                "residency.slots: a pool that shares GPU slots has a fixed replica count "
                "(no autoscale)"
            )
        scale, count = self.autoscale, self.replicas
        if (
            scale is not None
            and count is not None
            and not scale.min_replicas <= count <= scale.max_replicas
        ):
            raise ValueError(
                f"replicas: {count} is outside autoscale's "
                f"[{scale.min_replicas}, {scale.max_replicas}]"
            )
        try:
            get_gpu(self.gpu)
            if self.engine is EngineKind.SIM:
                get_model(self.served_model)
        except CatalogError as error:
            raise ValueError(str(error)) from None
        return self

    def _check_external(self) -> None:
        if self.residency.on_demand or self.residency.slots is not None:
            raise ValueError(
                "residency: an external model's engine is run by someone else (its sleep "
                "mode and GPUs are not ours to manage)"
            )
        if not self.endpoints:
            raise ValueError("an external model needs at least one entry in endpoints")
        for url in self.endpoints:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"endpoints: {url!r} is not an http(s) URL")
        if self.ca_file is not None and not any(
            url.startswith("https://") for url in self.endpoints
        ):
            raise ValueError("ca_file: no endpoint is an https:// URL")
        if self.autoscale is not None:
            raise ValueError("an external model cannot autoscale: nothing here starts it")
        set_here = [
            name
            for name in ("gpu_memory_utilization", "max_model_len", "env")
            if getattr(self, name)
        ]
        if set_here:
            raise ValueError(
                f"{', '.join(set_here)}: an external model's engine is configured by "
                "whoever runs it"
            )
        if self.replicas is not None and self.replicas > len(self.endpoints):
            raise ValueError(
                f"replicas: {self.replicas} wanted, {len(self.endpoints)} endpoint(s) given"
            )

    @model_validator(mode="after")
    def _readable_args(self) -> ModelConfig:
        # Reading the profile here makes a bad flag in `args` the file's error, not a replica's.
        if self.profile().tp != self.tp:
            raise ValueError(
                "args: --tensor-parallel-size: set `tp` instead (it is the GPUs a replica takes)"
            )
        return self

    @property
    def spot_settings(self) -> SpotConfig | None:
        """A spot pool's settings (given, or the defaults); ``None``: not a spot pool."""
        if self.capacity is not Capacity.SPOT:
            return None
        return self.spot or SpotConfig()

    def on_demand_price(self) -> float:
        """What one of this pool's GPUs costs an hour on demand (the catalog's price): a
        spot pool's stand-ins pay it (``spot.fallback: on_demand``)."""
        return get_gpu(self.gpu).price_per_hour_usd

    def usd_per_gpu_hour(self) -> float:
        """What one of this pool's GPUs costs an hour: the catalog's on-demand price, or a
        spot pool's own (``spot.usd_per_gpu_hour``; default: less ``SPOT_DISCOUNT``)."""
        price = self.on_demand_price()
        spot = self.spot_settings
        if spot is None:
            return price
        if spot.usd_per_gpu_hour is not None:
            return spot.usd_per_gpu_hour
        return round(price * (1.0 - SPOT_DISCOUNT), 4)

    @property
    def served_model(self) -> str:
        """The model the engine loads (``model``, or ``name``)."""
        return self.model or self.name

    def profile(self, seed: int | None = None) -> ReplicaProfile:
        """The engine flags of this model's replicas: ``tp``, ``max_model_len``,
        ``gpu_memory_utilization``, ``prefix_caching`` and ``lora``'s (``--enable-lora``,
        ``--max-loras``, ``--max-cpu-loras`` twice that, ``--max-lora-rank``), then
        ``args``, which win.

        ``seed`` is the fleet's seed (live: ``gateway.seed``; simulated: the run's seed):
        every replica of every pool runs with it as ``--seed``, unless ``args`` set one
        (docs/design/replica-profile.md). ``None``: no ``--seed`` (the engine's default).
        """
        args = self.args
        if self.residency.on_demand and "--enable-sleep-mode" not in args:
            args = (*args, "--enable-sleep-mode")  # vLLM's, and the sim engine's
        base = ReplicaProfile(
            tp=self.tp,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_prefix_caching=self.prefix_caching,
            seed=seed,
        )
        if self.lora is not None:  # what the engine registers is what the controller placed
            lora = self.lora
            base = replace(
                base,
                enable_lora=True,
                max_loras=lora.max_loras,
                # room for loads over the cap (every slot busy): the engine keeps them
                # cached, and runs at most max_loras adapters in a batch, as vLLM does
                max_cpu_loras=2 * lora.max_loras,
                max_lora_rank=lora.max_lora_rank,
            )
        try:
            return ReplicaProfile.from_argv(args, base)
        except ValueError as error:
            raise ValueError(f"args: {error}") from None

    @property
    def max_num_seqs(self) -> int:
        """The engines' running-batch cap: the profile's ``--max-num-seqs``, else vLLM's 256
        (an external model: 256, its engine's flags are not known here). The one value
        saturation is judged by, for this pool's admission gate and its autoscaler, live
        and simulated (the simulator's replicas run with it too)."""
        return self.profile().running_batch_cap

    @property
    def context_length(self) -> int | None:
        """The longest context the pool's engines serve, as far as the fleet file says: its
        ``max_model_len`` (or ``--max-model-len`` in ``args``), else the catalog model's
        context for a sim engine; ``None``: not known here (a vLLM model the catalog does not
        list, an external engine). A prompt estimated longer falls back (``fallbacks``)."""
        length = self.profile().max_model_len
        if length is not None or self.engine is EngineKind.EXTERNAL:
            return length
        try:
            return get_model(self.served_model).max_context
        except CatalogError:
            return None

    @property
    def memory(self) -> float:
        """The share of each GPU's memory an awake engine takes (``gpu_memory_utilization``,
        vLLM's 0.9 by default): what it holds of a shared slot (``residency.slots``)."""
        share = self.profile().gpu_memory_utilization
        return DEFAULT_MEMORY if share is None else share

    @property
    def engine_env(self) -> dict[str, str]:
        """The environment of its engines: ``env``, and ``VLLM_SERVER_DEV_MODE=1`` for an
        ``on_demand`` model (vLLM serves ``/sleep`` and ``/wake_up`` only then),
        ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` for one with ``lora`` (vLLM serves
        ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` only then)."""
        env: dict[str, str] = {}
        if self.residency.on_demand:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.lora is not None:  # the controller loads and unloads adapters at run time
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return {**env, **self.env}

    @property
    def startup_timeout(self) -> float:
        """The startup budget in seconds (``startup.timeout`` or the engine kind's default)."""
        return self.startup.timeout or STARTUP_TIMEOUTS[self.engine]

    @property
    def replica_count(self) -> int:
        if self.replicas is not None:
            return self.replicas
        if self.autoscale is not None:
            return self.autoscale.min_replicas
        return len(self.endpoints) if self.engine is EngineKind.EXTERNAL else 2


class Timeouts(_Strict):
    """Upstream timeouts, in seconds, enforced by the gateway on every attempt."""

    connect: float = Field(1.0, gt=0.0)
    """Opening a connection to a replica (a refused one fails at once)."""
    first_byte: float = Field(60.0, gt=0.0)
    """From sending the request to the first byte of the response body. A non-streaming
    response arrives whole, so this bounds its generation too."""
    idle_stream: float = Field(30.0, gt=0.0)
    """Between two chunks of a streamed response."""
    request_body: float = Field(30.0, gt=0.0)
    """Reading a client's whole request body (408 past it): a client that trickles its
    body does not hold a connection and a handler forever."""


class RetryConfig(_Strict):
    """Retries of failures before the first byte, on the next replica of the ranking, and
    resumes of streams that broke after it."""

    max_retries: int = Field(2, ge=0)
    """Further attempts per request after the first."""
    budget_percent: float = Field(20.0, ge=0.0, le=100.0)
    """Retries in flight may be at most this share of the requests in flight (Envoy's retry
    budget), so a failing fleet does not double its own load …"""
    min_retry_concurrency: int = Field(3, ge=0)
    """… but this many retries at once are always allowed."""
    max_resumes: int = Field(2, ge=0)
    """Times one stream that broke after its first byte is resumed on another replica (the
    gateway splices the continuation into the client's stream; docs/gateway.md, "Resuming a
    stream"). 0: a broken stream ends with an error event. Resumes do not draw on the retry
    budget."""
    resume_within: float = Field(300.0, gt=0.0)
    """Seconds after its arrival past which a broken stream is no longer resumed."""


class AutoscalerConfig(_Strict):
    """The gateway's autoscaling loop, for the models that have ``autoscale``."""

    interval: float = Field(1.0, gt=0.0)
    """Seconds between two decisions per pool (sooner when a decision's ``next_at`` or a
    request held at an empty pool asks)."""
    hold_requests: int = Field(256, ge=0)
    """Requests an autoscaled pool with no ready replica holds at once (scale from zero); one
    more gets a 503 with ``Retry-After`` at once. 0: never hold."""
    hold_timeout: float = Field(60.0, gt=0.0)
    """Longest wait of a held request for a ready replica; then a 503 with ``Retry-After``.
    A cold start takes ``startup.provision`` + the engine's load: set this above it."""


class BatchConfig(_Strict):
    """The Batch API (``/v1/files``, ``/v1/batches``) and the runner that feeds batch lines
    through the gateway's own request path (docs/batch.md)."""

    enabled: bool = True
    """Serve the routes and run the runner. They need a store: with auth on the tenants'
    one; with auth off ``gpufleet up`` opens the same database (``tenants.database_url``,
    ``$GPUFLEET_DB_URL`` or SQLite in ``$GPUFLEET_HOME``) for them."""
    lines_in_flight: int = Field(32, ge=1)
    """Lines of one batch this gateway runs at once (each an in-process request in the
    ``batch`` admission class)."""
    lease: float = Field(30.0, gt=0.0)
    """Seconds a claimed line stays this gateway's without a renewal (renewed every third
    of it while it runs): a gateway killed mid-line gives its lines back this long after."""
    poll_interval: float = Field(1.0, gt=0.0)
    """Seconds between two looks for batches to run (new, cancelled, expired, or lines
    another gateway gave back); a batch created through this gateway starts at once."""
    max_backoff: float = Field(30.0, gt=0.0)
    """Longest wait before a line refused for now (429 quota, 503 no room) is tried again;
    the waits double from ``Retry-After`` (or 0.5 s) up to it."""
    order: Literal["prefix", "input"] = "prefix"
    """The order a batch's lines run in: ``prefix`` sorts them by their prompts' text, so
    lines that share a prefix (a system prompt, a document) run side by side and the
    engines' prefix caches pay; ``input``: the file's order. Fixed when a batch starts."""
    spare: SpareConfig | None = SpareConfig()
    """How batch lines use spare capacity: each pool's controller holds them at a gate and
    lets them in only into the room the interactive load leaves (``SpareConfig``: a target
    share of the slots, AIMD on engine queueing and KV pressure; docs/batch.md). ``null``:
    no gate (lines are admitted like any request of their class). The simulator gates its
    ``batch``-class requests by the same rule."""


class TLSConfig(_Strict):
    """HTTPS on the gateway's port (docs/gateway.md, TLS): its certificate, reloaded when the
    files change."""

    cert_file: ExistingFile
    """PEM certificate chain: the gateway's certificate first, then any intermediates."""
    key_file: ExistingFile
    """PEM private key of that certificate (not encrypted)."""
    reload_interval: float = Field(5.0, gt=0.0)
    """Seconds between two looks at the files' modification times. A changed pair is loaded
    for the handshakes that follow; a pair that does not load is logged and the one in use
    kept."""


class TracingConfig(_Strict):
    """OpenTelemetry traces of the requests the gateway proxies, sent over OTLP/HTTP
    (docs/tracing.md). Needs the ``tracing`` extra (``pip install 'gpufleet[tracing]'``)."""

    endpoint: str
    """The collector's OTLP/HTTP traces URL (``http://127.0.0.1:4318/v1/traces``)."""
    sample: float = Field(1.0, ge=0.0, le=1.0)
    """The share of new traces kept (by trace id). A request whose client sends a
    ``traceparent`` follows the client's choice instead."""
    service_name: str = Field("gpufleet-gateway", min_length=1)
    """The ``service.name`` of the gateway's spans."""
    headers: dict[str, str] = {}
    """Headers of every export (a collector's API key)."""
    export_interval: float = Field(1.0, gt=0.0)
    """Seconds between two exports of the spans that ended meanwhile (sooner when 512 wait).
    Each attempt sends its span as the engine's ``traceparent``: an engine that traces
    (vLLM's ``--otlp-traces-endpoint`` in a model's ``args``) joins the same trace."""

    @field_validator("endpoint")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"{value!r} is not an http(s) URL")
        return value


class GatewayConfig(_Strict):
    """The gateway's address and its upstream behaviour."""

    host: str = "127.0.0.1"
    """The address the gateway listens on. Anything but loopback (``127.0.0.1``, ``::1``,
    ``localhost``) requires API keys unless the file writes ``tenants.auth: false``."""
    port: int = Field(8000, ge=0, le=65535)
    """0: any free port (the command prints which)."""
    tls: TLSConfig | None = None
    """Serve HTTPS with this certificate (default: plain HTTP)."""
    timeouts: Timeouts = Timeouts()
    retry: RetryConfig = RetryConfig()
    scrape_interval: float = Field(0.2, gt=0.0)
    """Seconds between two scrapes of each replica's ``/metrics`` (for ``kv_aware`` and
    ``prefix_aware`` routing)."""
    retry_after: int = Field(1, ge=0)
    """The ``Retry-After`` seconds of a 503 when no replica can take a request."""
    max_connections: int = Field(1000, ge=1)
    """Upstream connections, kept alive and pooled, over all replicas."""
    seed: int = 0
    """Seed of the routers' and health policies' tie-breaking draws."""
    autoscaler: AutoscalerConfig = AutoscalerConfig()
    """The autoscaling loop and the hold queue of scale from zero (docs/gateway.md)."""
    redis_url: str | None = None
    """A Redis the gateways share (``redis://host:6379/0``): the tenants' quotas (rpm, tpm,
    concurrency) live there, so N gateways hold a tenant to one limit (docs/tenants.md).
    With it, ``gpufleet deploy k8s`` runs two gateway replicas. Routing load, health and the
    admission queue stay in each gateway's memory."""
    batch: BatchConfig = BatchConfig()
    """The Batch API and its runner (docs/batch.md)."""
    tracing: TracingConfig | None = None
    """OpenTelemetry traces of proxied requests (docs/tracing.md); ``None``: none (the
    request path then pays nothing for them)."""
    metrics_allow: tuple[str, ...] = ()
    """Client networks (CIDR, ``127.0.0.1/32``, ``10.0.0.0/8``, ``::1/128``) that read
    ``/metrics`` without a credential when auth is on, so Prometheus needs no key (default:
    none; with auth on ``/metrics`` then needs a viewer credential or a tenant's key). The
    address is the TCP peer's: behind a proxy, the proxy's."""

    @field_validator("metrics_allow")
    @classmethod
    def _networks(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for network in value:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise ValueError(f"{network!r} is not an address or network") from None
        return value

    @model_validator(mode="after")
    def _redis_scheme(self) -> GatewayConfig:
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError(f"redis_url: {self.redis_url!r} is not a redis:// URL")
        return self


class TenantsConfig(_Strict):
    """Tenants, API keys, quotas and admission (docs/tenants.md)."""

    auth: bool = False
    """Require an API key on every path but ``/health`` and ``/ready`` (``gpufleet up --auth``
    turns it on whatever this says). Off: one anonymous tenant, no ledger, no queue.

    Not written in the file, ``gpufleet up`` turns it on when the gateway listens on an
    address other than loopback (:func:`is_loopback`); ``auth: false`` written there keeps
    it off, with a warning. The simulator reads the value as written."""

    @property
    def auth_written(self) -> bool:
        """Whether the file says ``auth`` (``auth: false`` is a choice; no ``auth``, a default)."""
        return "auth" in self.model_fields_set

    database_url: str | None = None
    """Where tenants, keys, the ledger and the audit log live: ``postgresql://…`` or
    ``sqlite:///path`` (default: ``$GPUFLEET_DB_URL``, else SQLite in ``$GPUFLEET_HOME``)."""
    admin_key_env: str = "GPUFLEET_ADMIN_KEY"
    """The environment variable holding the admin credential for ``/admin`` …"""
    admin_key_file: str | None = None
    """… or a file holding it (read at start; the variable wins)."""
    admission: AdmissionConfig = AdmissionConfig()
    """The gateway's queue when a pool is saturated, and fair sharing across tenants."""
    refresh_interval: float = Field(0.5, gt=0.0)
    """Seconds between two reloads of keys and tenants (a revoked key stops working within
    this, or at once when revoked through this gateway's admin API)."""


class RuntimeKind(StrEnum):
    """Where a fleet's replicas run."""

    LOCAL = "local"
    """Child processes of ``gpufleet up`` (docs/design/local-runtime.md)."""
    KUBERNETES = "kubernetes"
    """Pods of each pool's Deployment; the gateway discovers them and scales the Deployments
    (operator mode, docs/kubernetes.md)."""


class RuntimeConfig(_Strict):
    """Where the replicas run, and how the Kubernetes operator mode reaches its cluster."""

    kind: RuntimeKind = RuntimeKind.LOCAL
    namespace: str | None = None
    """The pools' namespace (kubernetes); default: the gateway pod's own namespace."""
    api_server: str | None = None
    """The API server's URL (kubernetes); default: in-cluster, from the pod's service account.
    ``http://127.0.0.1:8001`` reaches a cluster through ``kubectl proxy``."""
    resync_s: float = Field(30.0, gt=0.0)
    """Seconds between two reads of each pool's Deployment scale (kubernetes)."""
    drain_timeout_s: float | None = Field(None, gt=0.0)
    """Longest wait for a replica's in-flight requests before a scale-down removes it anyway
    (kubernetes); default: ``gateway.timeouts.first_byte``."""
    reclaim: ReclaimConfig = ReclaimConfig()
    """Which nodes are being taken back (kubernetes): their replicas get a preemption notice
    (docs/kubernetes.md, "Nodes taken back")."""

    @model_validator(mode="after")
    def _consistent(self) -> RuntimeConfig:
        if self.namespace is not None and not _NAMESPACE.fullmatch(self.namespace):
            raise ValueError(f"namespace {self.namespace!r} is not a DNS label")
        if self.api_server is not None and not self.api_server.startswith(("http://", "https://")):
            raise ValueError(f"api_server: {self.api_server!r} is not an http(s) URL")
        return self


def _runtime_kind(value: object) -> object:
    return {"kind": value} if isinstance(value, str) else value


def _variants(value: object) -> object:
    """``variants`` as written: a mapping of pool to weight, a list of pool names (weight 1
    each), or a list of ``{pool, weight}`` mappings (the form a recording's header keeps)."""
    if isinstance(value, dict):
        return [{"pool": pool, "weight": weight} for pool, weight in value.items()]
    if isinstance(value, list | tuple):
        return [{"pool": v} if isinstance(v, str) else v for v in value]
    return value


class VariantConfig(_Strict):
    """One variant of a served name: a pool and its share of the name's traffic."""

    pool: str
    """A pool: a ``models`` entry's ``name``."""
    weight: float = 1.0
    """Its share is ``weight / Σ weights`` of the name's variants (80 and 20: 80 %, 20 %).
    0: none yet (a version waiting for its rollout); one variant at least is positive."""

    @field_validator("weight")
    @classmethod
    def _positive(cls, value: float) -> float:
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{value:g}: a variant's weight must be a number ≥ 0")
        return value


class ServedConfig(_Strict):
    """A name clients send as ``model`` (an alias, or a model with several versions): the
    variants (pools) it is served by and the names it falls back to."""

    name: str
    variants: Annotated[tuple[VariantConfig, ...], BeforeValidator(_variants)]
    """The pools that serve it, with weights; a request's session key (``x-session-id``, or
    the OpenAI ``user`` field) picks one, the same one every time (docs/fleet-file.md)."""
    fallbacks: tuple[str, ...] = ()
    """Served names tried next, in order, when the chosen variant cannot answer (5xx and
    timeouts on every attempt, shed, no replica) or the prompt is longer than its context.
    Flat, as LiteLLM's: a fallback's own ``fallbacks`` are not followed."""
    rollout: RolloutConfig | None = None
    """A rollout to one of its variants, started with the gateway (or the simulation):
    steps, analysis, automatic rollback (docs/fleet-file.md, "Rollouts")."""

    @model_validator(mode="after")
    def _consistent(self) -> ServedConfig:
        if not _SERVED_NAME.fullmatch(self.name):
            raise ValueError(
                f"name {self.name!r}: use letters, digits and . _ : / @ + - "
                "(at most 200 characters, starting with a letter or digit)"
            )
        pools = [v.pool for v in self.variants]
        if not pools:
            raise ValueError("variants: a served name needs at least one pool")
        for pool in pools:
            if pools.count(pool) > 1:
                raise ValueError(f"variants: pool {pool!r} is given twice")
        if not any(v.weight > 0 for v in self.variants):
            raise ValueError("variants: one variant at least needs a positive weight")
        if self.rollout is not None:
            if self.rollout.to not in pools:
                raise ValueError(
                    f"rollout.to: {self.rollout.to!r} is not one of its variants "
                    f"({', '.join(pools)})"
                )
            if not any(v.weight > 0 for v in self.variants if v.pool != self.rollout.to):
                raise ValueError(
                    "rollout: no other variant of positive weight to roll from "
                    f"(give the old version a weight, {self.rollout.to!r} 0)"
                )
        return self


class FleetConfig(_Strict):
    """A whole fleet file."""

    models: tuple[ModelConfig, ...] = Field(min_length=1)
    gateway: GatewayConfig = GatewayConfig()
    tenants: TenantsConfig = TenantsConfig()
    runtime: Annotated[RuntimeConfig, BeforeValidator(_runtime_kind)] = RuntimeConfig()
    """``local`` (default) or ``kubernetes``: a kind, or a mapping with ``kind`` and settings."""
    served: tuple[ServedConfig, ...] = ()
    """Served names over the pools: aliases, weighted variants, fallbacks. A pool that no
    entry lists as a variant is served under its own name (its ``fallbacks`` apply)."""

    @model_validator(mode="after")
    def _unique(self) -> FleetConfig:
        seen: set[str] = set()
        for model in self.models:
            if model.name in seen:
                raise ValueError(f"model {model.name!r} is given twice")
            seen.add(model.name)
        return self

    @model_validator(mode="after")
    def _slots(self) -> FleetConfig:
        check_slots(self.models)
        return self

    @model_validator(mode="after")
    def _served(self) -> FleetConfig:
        """Every served name unique and over known pools; every fallback a served name."""
        pools = {m.name: m for m in self.models}
        explicit: set[str] = set()
        variants: dict[str, str] = {}
        for i, entry in enumerate(self.served):
            where = f"served[{i}] ({entry.name!r})"
            if entry.name in explicit:
                raise ValueError(f"{where}: the name is given twice")
            explicit.add(entry.name)
            for v in entry.variants:
                if v.pool not in pools:
                    raise ValueError(
                        f"{where}: variant {v.pool!r} is not a pool (models: {', '.join(pools)})"
                    )
                variants.setdefault(v.pool, entry.name)
            if entry.name in pools and entry.name not in {v.pool for v in entry.variants}:
                raise ValueError(
                    f"{where}: the name is a pool's; list pool {entry.name!r} among its "
                    "variants or rename one of them"
                )
        for name, model in pools.items():
            if name in variants and model.fallbacks:
                raise ValueError(
                    f"model {name!r}: fallbacks: the pool is a variant of {variants[name]!r}; "
                    "write its fallbacks on that served entry"
                )
        self._adapter_names(set(pools) | explicit)
        routes = self.served_names()
        names = [r.name for r in routes]
        for route in routes:
            for target in route.fallbacks:
                if target == route.name:
                    raise ValueError(
                        f"served name {route.name!r}: fallbacks: it falls back to itself (a cycle)"
                    )
                if target not in names:
                    raise ValueError(
                        f"served name {route.name!r}: fallbacks: {target!r} is not a served "
                        f"name (served: {', '.join(names)})"
                    )
                if route.fallbacks.count(target) > 1:
                    raise ValueError(
                        f"served name {route.name!r}: fallbacks: {target!r} is given twice"
                    )
        return self

    def _adapter_names(self, taken: set[str]) -> None:
        """``ValueError`` for a LoRA adapter named as a pool, a served name or another."""
        for model in self.models:
            for adapter in model.lora.adapters if model.lora is not None else ():
                if adapter.name in taken:
                    raise ValueError(
                        f"model {model.name!r}: lora: adapter {adapter.name!r} is already a "
                        "pool, a served name or another adapter"
                    )
                taken.add(adapter.name)

    def served_names(self) -> tuple[ServedConfig, ...]:
        """Every name the gateway serves: the ``served`` entries, then each pool that no
        entry lists as a variant, under its own name (one variant of weight 1, the pool's
        ``fallbacks``), in the file's order, then the pools' LoRA adapters (each over its
        pool). The first is what the simulator sends a trace's
        requests that name no model to."""
        listed = {v.pool for entry in self.served for v in entry.variants}
        own = tuple(
            ServedConfig(name=m.name, variants=(VariantConfig(pool=m.name),), fallbacks=m.fallbacks)
            for m in self.models
            if m.name not in listed
        )
        adapters = tuple(
            ServedConfig(name=a.name, variants=(VariantConfig(pool=m.name),))
            for m in self.models
            if m.lora is not None
            for a in m.lora.adapters
        )
        return self.served + own + adapters

    def adapters(self) -> dict[str, str]:
        """Every LoRA adapter's served name, and the pool that serves it."""
        return {a.name: m.name for m in self.models if m.lora is not None for a in m.lora.adapters}

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)


def is_loopback(host: str) -> bool:
    """Whether a gateway bound to ``host`` is reachable from this machine only: ``localhost``
    or a loopback address (``127.0.0.0/8``, ``::1``). ``0.0.0.0``, ``::``, ``""`` and every
    other name are not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class FleetFileError(ValueError):
    """A fleet file that cannot be read or does not validate; the message says where."""


DEFAULT_FLEET: Final = Path(__file__).parent / "data" / "default-fleet.yaml"
"""The fleet ``gpufleet up`` serves when no ``--fleet`` is given."""


def load_fleet(path: Path | str = DEFAULT_FLEET) -> FleetConfig:
    """Read and validate a fleet file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise FleetFileError(f"{path}: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise FleetFileError(f"{path}: not valid YAML: {error}") from None
    return parse_fleet(data, source=str(path))


def parse_fleet(data: Any, source: str = "fleet") -> FleetConfig:
    """Validate a fleet file's content (a mapping, as YAML loads it)."""
    if not isinstance(data, dict):
        raise FleetFileError(f"{source}: expected a mapping with `models`, got {_kind(data)}")
    try:
        return FleetConfig.model_validate(data)
    except pydantic.ValidationError as error:
        raise FleetFileError(f"{source}: {describe(error)}") from None


def describe(error: pydantic.ValidationError) -> str:
    """The first error as ``models[0].routing.balance_rel: message`` (and how many more)."""
    first = error.errors()[0]
    where = _path(first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return f"{where}: {message}{more}" if where else f"{message}{more}"


_UNION_TAGS: Final = frozenset(
    {"round_robin", "least_request", "kv_aware", "prefix_aware", "prefix_precise", "session"}
)


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_TAGS and i > 0 and loc[i - 1] == "routing":
            continue  # pydantic names the union member; the user wrote `routing.<field>`
        else:
            out += f".{part}" if out else part
    return out


def _kind(data: object) -> str:
    return "nothing" if data is None else type(data).__name__
