"""What one pool controller is told at birth: the fleet file's entry, read once."""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet.config import (
    Capacity,
    FleetConfig,
    ModelConfig,
    RetryConfig,
    SpotConfig,
    SpotFallback,
)
from gpufleet.policy import (
    AdmissionConfig,
    AutoscaleConfig,
    HealthConfig,
    KVAwareConfig,
    LoraConfig,
    PrecisePrefixConfig,
    PrefixSettings,
    RouterConfig,
    SpareConfig,
)


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """One model pool's rules, as both shells run them."""

    model: str
    index: int
    """The pool's place in the fleet file: its router draws from ``Random(seed × 1000 +
    2 × index)``, its health policy from ``… + 1``."""
    seed: int
    routing: RouterConfig
    health: HealthConfig
    retry: RetryConfig
    max_num_seqs: int
    admission: AdmissionConfig | None
    """The admission queue (``None``: every request starts at once)."""
    autoscale: AutoscaleConfig | None
    autoscale_interval: float = 1.0
    hold_requests: int = 0
    """Requests a pool with no routable replica holds while one is on its way (a replica
    starting, or an autoscaled pool scaling from zero); 0: none."""
    hold_timeout: float = 60.0
    context: int | None = None
    """The longest context the pool's engines serve (``ModelConfig.context_length``;
    ``None``: not known): a longer prompt goes to a fallback, if its served name has one."""
    spare: SpareConfig | None = None
    """The gate of the ``batch`` class (``gateway.batch.spare``): batch requests start only
    into the room interactive load leaves (``None``: admitted like any other class)."""
    abandon_before: float = SpotConfig().abandon_before
    """Seconds before a preemption notice's deadline at which the attempts still on the
    replica are ended (``spot.abandon_before``; any pool may get a notice)."""
    lora: LoraConfig | None = None
    """The pool's LoRA adapters and their placement (``None``: it serves none)."""
    batch_only: bool = False
    """A spot pool that takes only the ``batch`` class as a variant of a served name
    (``capacity: spot`` without ``spot.interactive``)."""
    capacity: Capacity = Capacity.ON_DEMAND
    spot_fallback: SpotFallback = SpotFallback.WAIT
    """A spot pool's reclaimed replica's capacity when no spot GPU is to be had
    (``spot.fallback``)."""
    by_priority: bool = False
    """Its engines schedule by request priority (``--scheduling-policy priority``): its
    Routes of batch-class requests carry ``priority`` (vLLM's: a lower urgency)."""

    @classmethod
    def of(
        cls,
        fleet: FleetConfig,
        model: ModelConfig,
        *,
        seed: int | None = None,
        admission: bool | None = None,
        autoscale: bool = True,
        autoscale_interval: float | None = None,
    ) -> PoolSettings:
        """``model``'s pool of ``fleet``; ``admission`` defaults to ``tenants.auth`` (the
        gateway queues only with auth on), ``seed`` to ``gateway.seed``; ``autoscale=False``:
        nothing acts on scaling decisions (a gateway without an actuator), so none is made."""
        gateway = fleet.gateway
        admitting = fleet.tenants.auth if admission is None else admission
        return cls(
            model=model.name,
            index=[m.name for m in fleet.models].index(model.name),
            seed=gateway.seed if seed is None else seed,
            routing=model.routing,
            health=model.health,
            retry=gateway.retry,
            max_num_seqs=model.max_num_seqs,
            admission=fleet.tenants.admission if admitting else None,
            autoscale=model.autoscale if autoscale else None,
            autoscale_interval=(
                gateway.autoscaler.interval if autoscale_interval is None else autoscale_interval
            ),
            hold_requests=gateway.autoscaler.hold_requests,
            hold_timeout=gateway.autoscaler.hold_timeout,
            context=model.context_length,
            spare=gateway.batch.spare,
            abandon_before=(model.spot or SpotConfig()).abandon_before,
            batch_only=(spot := model.spot_settings) is not None and not spot.interactive,
            lora=model.lora,
            capacity=model.capacity,
            spot_fallback=(model.spot or SpotConfig()).fallback,
            by_priority=model.profile().scheduling_policy == "priority",
        )

    @property
    def scraped(self) -> bool:
        """Whether the pool's engines are scraped: its router reads their load, or its
        admission gauge or autoscaler does. One rule for both shells. The batch gate
        reads the scrapes where they are taken, and its own counts everywhere."""
        reads = isinstance(self.routing, KVAwareConfig | PrefixSettings)
        return reads or self.admission is not None or self.autoscale is not None

    @property
    def hashes(self) -> bool:
        """Whether the router reads prefix hashes (only then are they computed)."""
        return isinstance(self.routing, PrefixSettings)

    @property
    def kv_events(self) -> bool:
        """Whether the router reads the engines' KV events and the prompts' engine block
        hashes (``prefix_precise``): only then does a shell subscribe and hash."""
        return isinstance(self.routing, PrecisePrefixConfig)

    @property
    def holds(self) -> bool:
        """A request that finds no routable replica waits for one even when none is
        starting (an autoscaled pool: it scales from zero)."""
        return self.autoscale is not None and self.hold_requests > 0
