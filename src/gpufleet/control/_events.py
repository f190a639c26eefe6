"""What the shells tell the pool controller, and what it tells them back.

Events carry no time: the controller is called as ``handle(now, event)``. Commands are plain
values the shell carries out (send an attempt, answer an error, probe, scale). Nothing changes
an event or a command once made (``dataclasses.replace`` makes another); the ones made per
request (``Arrived``, ``AttemptFailed``, ``Finished``, ``ClientGone``, ``Route``, ``Reject``)
are not frozen only because a frozen dataclass's ``__init__`` costs about 5× a plain one's,
on the gateway's hot path. Both have a JSON form (:func:`event_to_json`,
:func:`command_to_json`), so a live run's events can be recorded and replayed into a fresh
controller, and its decisions compared line by line::

    shell ──► Replicas · Scraped · ProbeAnswered · Standbys          (what the runtime sees)
              Arrived · AttemptFailed · Finished · ClientGone · Tick  (requests and time)
              Weights                                   (a served name's variant weights)
              RolloutStart · RolloutAct · Latencies     (rollouts: docs/design/rollout.md)
              Resident                        (an engine fell asleep or woke: residency)
              KvEvents                     (an engine's KV-cache events: docs/kv-events.md)
              Preempting                (a spot replica's preemption notice: docs/spot.md)
              Reclaimed · SpotMarket       (a replica's GPUs taken; spot GPUs to be had)
    controller ──► Route · Reject · Fallback · Probe · Ejected · Scale  (what the shell does)
                   RolloutStep                             (a rollout's decision)
                   Sleep · Wake                           (residency: _residency_events.py)
                   KvResync                    (ask an engine's replay socket for a gap)
                   Abandon          (end the attempts on a replica that failed its checks)
                   Recall         (stop a batch line's attempt: its slot goes to interactive)
                   Replace              (a node of spot or on-demand GPUs for a replica)

A request's events name its *served* name (``Arrived``: what the client sent as ``model``)
or its pool; the controller knows which pool a request is in (a variant, a fallback), and a
recording keeps the pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from gpufleet.control._residency_events import (
    Resident,
    Sleep,
    Wake,
    resident_from_json,
    resident_to_json,
    sleep_to_json,
    wake_to_json,
)
from gpufleet.control._spot_events import (
    Reclaimed,
    Replace,
    SpotMarket,
    reclaimed_from_json,
    reclaimed_to_json,
    replace_to_json,
    spot_market_from_json,
    spot_market_to_json,
)
from gpufleet.fleet import (
    KvBatch,
    KvCleared,
    KvEvent,
    KvRemoved,
    KvStored,
    Outcome,
    ReplicaId,
    ReplicaState,
    RouteRequest,
)
from gpufleet.policy import (
    EjectionRecord,
    PoolView,
    RolloutAction,
    RolloutConfig,
    RolloutDecision,
    ScaleDecision,
    Standby,
    decision_record,
)

# -- events -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplicaSeen:
    """One replica as the runtime reports it.

    ``incarnation`` names the process (the live gateway: its address; the simulator: its
    restart count); ``None`` while it has none. A new incarnation is a new process, whose
    health checks start over.
    """

    id: ReplicaId
    state: ReplicaState
    incarnation: str | None


@dataclass(frozen=True, slots=True)
class Replicas:
    """The runtime's whole list of ``model``'s replicas, oldest first (level-triggered)."""

    model: str
    replicas: tuple[ReplicaSeen, ...]


@dataclass(frozen=True, slots=True)
class ScrapedLoad:
    replica: ReplicaId
    running: int
    waiting: int
    kv_cache_usage: float


@dataclass(frozen=True, slots=True)
class Scraped:
    """A scrape round of ``model``'s engines; a replica not listed keeps its last load."""

    model: str
    loads: tuple[ScrapedLoad, ...]


@dataclass(frozen=True, slots=True)
class ProbeAnswered:
    model: str
    replica: ReplicaId
    ok: bool


@dataclass(frozen=True, slots=True)
class Standbys:
    """``model``'s prewarmed standbys now (the runtime's; the gateway never routes to them)."""

    model: str
    standbys: tuple[Standby, ...]


@dataclass(slots=True)  # made per request: not frozen (above)
class Arrived:
    """A request may start (it passed auth and quotas): choose its variant, admit it, then
    route it. ``request.model`` is the served name the client sent.

    ``priority`` indexes :data:`~gpufleet.policy.CLASSES`; ``deadline`` bounds its wait in
    the admission queue (``None``: the pool's ``max_wait``). ``resumable``: the shell can
    continue its answer on another replica if its stream breaks after the first byte (a
    stream of one choice that asks for nothing a continuation would change; the gateway's
    rule is in docs/gateway.md, "Resuming a stream"; every simulated request is one).
    ``recallable``: its answer comes whole (not streamed), so an attempt can be stopped and
    the request run again from the start without the client seeing anything: a batch line
    the spare-capacity gate may recall (docs/batch.md, "Recall"). ``budget``: the seconds
    to its first token the client allows (a latency class): among its served name's
    variants it goes to the cheapest predicted to meet it (docs/fleet-file.md, "Latency
    budgets").
    """

    request: RouteRequest
    priority: int = 0
    weight: float = 1.0
    deadline: float | None = None
    resumable: bool = False
    recallable: bool = False
    budget: float | None = None

    @property
    def model(self) -> str:
        return self.request.model


@dataclass(slots=True)  # made per request: not frozen (above)
class AttemptFailed:
    """The request's attempt on its replica failed; ``streamed``: after its first byte
    reached the client (no retry then; a resume, if the request is resumable)."""

    model: str
    request_id: str
    outcome: Outcome
    streamed: bool = False


@dataclass(slots=True)  # made per request: not frozen (above)
class Finished:
    """The request's attempt ended without a replica failure (answered, 4xx, or the client
    left mid-answer: ``CANCELLED``). ``work`` = (uncached prompt, output tokens) if known.
    ``ttft``: seconds from its arrival to its first byte, told where the controller reads
    it (``FleetController.times_first_tokens``: the batch gate's TTFT guard)."""

    model: str
    request_id: str
    outcome: Outcome = Outcome.SUCCESS
    work: tuple[int, int] | None = None
    ttft: float | None = None


@dataclass(slots=True)  # made per request: not frozen (above)
class ClientGone:
    """The client left while its request was queued, held or being answered."""

    model: str
    request_id: str


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed: do what fell due (health, queue deadlines, holds, autoscaling)."""


@dataclass(frozen=True, slots=True)
class Weights:
    """Served name ``model``'s variants get these weights from now on (``(pool, weight)``
    pairs; a variant not named keeps its weight). A weight may be 0 (the variant gets no new
    request), but one variant at least keeps a positive weight. What a rollout's step sets;
    sessions move only to a variant whose weight rose, or away from one whose weight fell."""

    model: str
    weights: tuple[tuple[str, float], ...]


@dataclass(frozen=True, slots=True)
class RolloutStart:
    """Roll served name ``model`` out to ``config.to`` (an operator, or a fleet file's
    ``rollout`` block). ``step``, ``phase`` and ``base`` restore one a restarted gateway had
    (its store's state; ``None``: a new one, from the name's weights now)."""

    model: str
    config: RolloutConfig
    step: int = 0
    phase: str | None = None
    base: tuple[tuple[str, float], ...] | None = None


@dataclass(frozen=True, slots=True)
class RolloutAct:
    """An operator's promote, pause, resume or abort of ``model``'s rollout."""

    model: str
    action: RolloutAction


@dataclass(frozen=True, slots=True)
class Latencies:
    """Latencies the shell measured on pool ``model`` since its last report, for the
    analysis of a rollout that pool is part of: each answered request's time to first token
    and, where known, its mean inter-token latency (seconds)."""

    model: str
    ttft: tuple[float, ...]
    itl: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class KvEvents:
    """KV-cache event batches from ``replica``'s engine process ``incarnation`` (as
    :class:`ReplicaSeen` names it), in the order received. ``replay``: the answer to a
    :class:`KvResync` (every batch the engine's replay buffer had from the asked seq on;
    empty when it had none, or could not be asked). A batch of another incarnation than the
    replica's current one is dropped: it is the old process's."""

    model: str
    replica: ReplicaId
    incarnation: str | None
    batches: tuple[KvBatch, ...]
    replay: bool = False


@dataclass(frozen=True, slots=True)
class Preempting:
    """The provider takes ``replica`` back at ``at`` (on the controller's clock): a spot
    GPU's preemption notice (a node's taint or termination notice, an admin call, a
    simulated draw). The one event that carries a time: the notice's deadline is what it
    says. From now on the replica takes no new attempt; the attempts still on it
    ``abandon_before`` seconds before ``at`` are ended (:class:`Abandon`), so they resume
    or retry elsewhere before the replica is gone (docs/spot.md)."""

    model: str
    replica: ReplicaId
    at: float


@dataclass(frozen=True, slots=True)
class AdapterAdded:
    """Pool ``model`` serves LoRA adapter ``name`` from now on (an operator registered it:
    ``POST /admin/adapters``): a served name over the pool, loaded where it is needed."""

    model: str
    name: str
    path: str
    rank: int


Event = (
    Replicas
    | Scraped
    | ProbeAnswered
    | Standbys
    | Arrived
    | AttemptFailed
    | Finished
    | ClientGone
    | Tick
    | Weights
    | RolloutStart
    | RolloutAct
    | Latencies
    | Resident
    | KvEvents
    | Preempting
    | AdapterAdded
    | Reclaimed
    | SpotMarket
)

# -- commands ---------------------------------------------------------------------------------


@dataclass(slots=True)  # made per request: not frozen (above)
class Route:
    """Send request ``request_id`` to ``replica`` (``retry``: a retry of an attempt that
    failed before the first byte).

    ``resume``: its stream broke after the first byte; continue it there (the prompt plus
    what the client already has, spliced into the same stream). ``policy``, ``panic`` and
    ``matched`` say how the router chose, ``held`` that it waited for a replica at an empty
    pool first (metrics). ``model``: the pool (a variant, or a fallback's) of a request whose
    served name is not simply one pool's own; empty for the others (the served name is the
    pool). The shell sends the pool's engines the pool's name as ``model`` (a LoRA
    adapter's request: the adapter's name). ``load``: the LoRA adapter the replica loads
    before it takes the request (``POST /v1/load_lora_adapter``); a request for an adapter
    whose load on that replica is still under way waits for it. ``priority``: the request
    ``priority`` the replica's engine gets (vLLM's, lower first; 0: none sent): a batch-class
    request to a pool whose engines schedule by priority gets ``BATCH``."""

    request_id: str
    replica: ReplicaId
    retry: bool = False
    policy: str = ""
    panic: bool = False
    matched: int = 0
    held: bool = False
    resume: bool = False
    model: str = ""
    load: str = ""
    priority: int = 0


class RejectReason:
    """Why a request got no replica (the shell's 503 says it in words)."""

    SHED: Final = "shed"
    EXPIRED: Final = "expired"
    NO_REPLICA: Final = "no_replica"
    HOLD_FULL: Final = "hold_full"
    HOLD_TIMEOUT: Final = "hold_timeout"
    EXHAUSTED: Final = "exhausted"
    """Every candidate failed, or the retry budget refused the next retry."""
    BROKEN: Final = "broken"
    """Its stream broke after the first byte and is not resumed (not resumable, no
    resumes left, past ``resume_within``, or no other replica): the client has an error
    event."""


@dataclass(slots=True)  # made per request: not frozen (above)
class Reject:
    """Request ``request_id`` ends without an answer from a replica (503, or an error
    event on a broken stream); ``budget``: a retry was refused by the retry budget."""

    request_id: str
    reason: str
    budget: bool = False
    model: str = ""
    """The pool it was last in, as on :class:`Route` (empty: the served name's own)."""


class FallbackReason:
    """Why a request left a served name for the next in its ``fallbacks``: a
    :class:`RejectReason` of the pool it was in (every one but ``broken``), or this."""

    CONTEXT: Final = "context"
    """Its prompt (the shell's estimate of its tokens) and the output it asks for are longer
    than the context of every variant of the name it leaves."""


@dataclass(frozen=True, slots=True)
class Fallback:
    """Request ``request_id`` goes from served name ``model`` to ``to`` (its variant
    ``pool``), because of ``reason`` (a :class:`FallbackReason`). The shell counts it; the
    request's next decision (a Route, or a Reject) follows, now or later."""

    request_id: str
    model: str
    to: str
    pool: str
    reason: str


@dataclass(frozen=True, slots=True)
class Probe:
    """Probe ``replica``'s health endpoint now; report :class:`ProbeAnswered`."""

    model: str
    replica: ReplicaId


@dataclass(frozen=True, slots=True)
class Ejected:
    """A line of the ejection log (made, dry-run, or refused by the limit)."""

    record: EjectionRecord


@dataclass(frozen=True, slots=True)
class Scale:
    """An autoscaling decision (one per decision, acting or not): ``decision`` and the
    ``view`` it was made on. The shell carries out its promotions, cold starts and drains,
    and logs every one."""

    decision: ScaleDecision
    view: PoolView
    buy: str = ""
    """What its new replicas (cold and prewarm starts) are bought as: ``""`` the pool's
    capacity; ``on_demand`` in a spot pool short of spot GPUs (``spot.fallback:
    on_demand``); ``none``: none can be had now (``fallback: wait``), the starts wait for a
    later decision (docs/spot.md)."""


@dataclass(frozen=True, slots=True)
class RolloutStep:
    """A rollout started, stepped, held, or ended (its weights are in force already): the
    shell logs it (one JSON line), counts it, audits it and persists ``state`` (what a
    restarted gateway resumes from: ``Rollout.snapshot``)."""

    decision: RolloutDecision
    state: dict[str, Any]


@dataclass(frozen=True, slots=True)
class KvResync:
    """``replica``'s KV events have a gap: ask its engine's replay socket for every batch
    from ``from_seq`` on, and report them as ``KvEvents(replay=True)``."""

    model: str
    replica: ReplicaId
    from_seq: int


@dataclass(frozen=True, slots=True)
class Abandon:
    """``replica`` just failed its active health checks with attempts in flight: a process
    that answers no probe (hung, its host gone) answers none of them either; or its
    preemption notice is about to fall due (:class:`Preempting`). End each of
    ``request_ids``' attempts there now and report it as ``AttemptFailed(TIMEOUT)``
    (``streamed`` when the client had its first byte), so it retries or resumes elsewhere
    instead of waiting out its timeouts (``health.active.abandon``; docs/design/retries.md)."""

    model: str
    replica: ReplicaId
    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Recall:
    """Stop batch line ``request_id``'s attempt on ``replica`` now: an interactive request
    just took the last of that replica's slots (``gateway.batch.spare.recall``). The shell ends
    it as it ends an abandoned one (the engine aborts it) and reports ``AttemptFailed``; the
    line waits at the spare-capacity gate again and runs from its start when there is room
    (it was recallable: nothing of its answer had reached the client)."""

    model: str
    replica: ReplicaId
    request_id: str


@dataclass(frozen=True, slots=True)
class UnloadAdapter:
    """Unload LoRA adapter ``adapter`` from ``replica`` (``POST /v1/unload_lora_adapter``):
    no request for it is in flight there, and a load the same instant needs its slot."""

    model: str
    replica: ReplicaId
    adapter: str


Command = (
    Route
    | Reject
    | Fallback
    | Probe
    | Ejected
    | Scale
    | RolloutStep
    | Sleep
    | Wake
    | KvResync
    | Abandon
    | Recall
    | UnloadAdapter
    | Replace
)

# -- JSON -------------------------------------------------------------------------------------


def event_to_json(event: Event) -> dict[str, Any]:  # noqa: PLR0911, PLR0912 - one match
    """The event as a JSON-ready dict (``kind`` names its class)."""
    match event:
        case Replicas(model=model, replicas=replicas):
            items = [[r.id, r.state.value, r.incarnation] for r in replicas]
            return {"kind": "replicas", "model": model, "replicas": items}
        case Scraped(model=model, loads=loads):
            rows = [[x.replica, x.running, x.waiting, x.kv_cache_usage] for x in loads]
            return {"kind": "scraped", "model": model, "loads": rows}
        case ProbeAnswered(model=model, replica=replica, ok=ok):
            return {"kind": "probe", "model": model, "replica": replica, "ok": ok}
        case Standbys(model=model, standbys=standbys):
            rows = [[s.id, s.ready, s.since] for s in standbys]
            return {"kind": "standbys", "model": model, "standbys": rows}
        case Arrived(
            request=r,
            priority=priority,
            weight=weight,
            deadline=deadline,
            resumable=resumable,
            recallable=recallable,
            budget=budget,
        ):
            line: dict[str, Any] = {
                "kind": "arrived",
                "model": r.model,
                "id": r.request_id,
                "hashes": list(r.prefix_hashes),
                "prompt_tokens": r.prompt_tokens,
                "session": r.session_key,
                "tenant": r.tenant,
                "priority": priority,
                "weight": weight,
                "deadline": deadline,
            }
            if resumable:  # absent: not resumable (and recordings made before resumes)
                line["resumable"] = True
            if recallable:  # absent: not recallable (and recordings made before recalls)
                line["recallable"] = True
            if r.max_tokens is not None:  # absent: not said (and recordings made before)
                line["max_tokens"] = r.max_tokens
            if budget is not None:  # absent: no latency budget
                line["budget"] = budget
            if r.block_hashes:  # absent: none (no KV-event routing, recordings made before)
                line["blocks"] = list(r.block_hashes)
            return line
        case AttemptFailed(model=model, request_id=rid, outcome=outcome, streamed=streamed):
            return {
                "kind": "failed",
                "model": model,
                "id": rid,
                "outcome": outcome.value,
                "streamed": streamed,
            }
        case Finished(model=model, request_id=rid, outcome=outcome, work=work, ttft=ttft):
            line = {
                "kind": "finished",
                "model": model,
                "id": rid,
                "outcome": outcome.value,
                "work": None if work is None else list(work),
            }
            if ttft is not None:  # absent: not timed (and recordings made before)
                line["ttft"] = ttft
            return line
        case ClientGone(model=model, request_id=rid):
            return {"kind": "gone", "model": model, "id": rid}
        case Tick():
            return {"kind": "tick"}
        case Weights(model=model, weights=weights):
            return {"kind": "weights", "model": model, "weights": [list(w) for w in weights]}
        case RolloutStart(model=model, config=config, step=step, phase=phase, base=base):
            line = {
                "kind": "rollout_start",
                "model": model,
                "config": config.model_dump(mode="json"),
            }
            if step or phase is not None or base is not None:  # a restored one
                line |= {"step": step, "phase": phase, "base": base and [list(b) for b in base]}
            return line
        case RolloutAct(model=model, action=action):
            return {"kind": "rollout_act", "model": model, "action": action.value}
        case Latencies(model=model, ttft=ttft, itl=itl):
            return {"kind": "latencies", "model": model, "ttft": list(ttft), "itl": list(itl)}
        case Resident():
            return resident_to_json(event)
        case KvEvents():
            return _kv_events_json(event)
        case Preempting(model=model, replica=replica, at=at):
            return {"kind": "preempting", "model": model, "replica": replica, "at": at}
        case Reclaimed():
            return reclaimed_to_json(event)
        case SpotMarket():
            return spot_market_to_json(event)
        case AdapterAdded(model=model, name=name, path=path, rank=rank):
            return {
                "kind": "adapter_added",
                "model": model,
                "name": name,
                "path": path,
                "rank": rank,
            }
    raise TypeError(f"not an event: {event!r}")


def _kv_events_json(event: KvEvents) -> dict[str, Any]:
    batches = [[b.seq, [_kv_event_json(e) for e in b.events]] for b in event.batches]
    line: dict[str, Any] = {
        "kind": "kv",
        "model": event.model,
        "replica": event.replica,
        "incarnation": event.incarnation,
        "batches": batches,
    }
    if event.replay:  # absent: a live delivery
        line["replay"] = True
    return line


def _kv_event_json(event: KvEvent) -> list[Any]:
    match event:
        case KvStored(hashes=hashes):
            return ["s", list(hashes)]
        case KvRemoved(hashes=hashes):
            return ["r", list(hashes)]
    return ["c"]


def _kv_event(row: list[Any]) -> KvEvent:
    match row:
        case ["s", hashes]:
            return KvStored(tuple(int(h) for h in hashes))
        case ["r", hashes]:
            return KvRemoved(tuple(int(h) for h in hashes))
        case ["c"]:
            return KvCleared()
    raise ValueError(f"not a KV event: {row!r}")


def _kv_events(d: dict[str, Any]) -> KvEvents:
    batches = tuple(
        KvBatch(int(seq), tuple(_kv_event(e) for e in events)) for seq, events in d["batches"]
    )
    incarnation = d["incarnation"]
    return KvEvents(
        str(d["model"]),
        ReplicaId(d["replica"]),
        None if incarnation is None else str(incarnation),
        batches,
        bool(d.get("replay", False)),
    )


def event_from_json(data: dict[str, Any]) -> Event:
    """The inverse of :func:`event_to_json`; ``ValueError`` for a line it cannot read."""
    try:
        return _EVENT_READERS[data["kind"]](data)
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise ValueError(f"not a recorded event: {data!r} ({error!r})") from None


def _arrived(d: dict[str, Any]) -> Arrived:
    request = RouteRequest(
        str(d["id"]),
        str(d["model"]),
        prefix_hashes=tuple(int(h) for h in d["hashes"]),
        prompt_tokens=int(d["prompt_tokens"]),
        session_key=d["session"],
        tenant=d["tenant"],
        max_tokens=None if d.get("max_tokens") is None else int(d["max_tokens"]),
        block_hashes=tuple(int(h) for h in d.get("blocks", ())),
    )
    deadline = d["deadline"]
    return Arrived(
        request,
        int(d["priority"]),
        float(d["weight"]),
        None if deadline is None else deadline,
        bool(d.get("resumable", False)),
        bool(d.get("recallable", False)),
        None if d.get("budget") is None else float(d["budget"]),
    )


def _rollout_start(d: dict[str, Any]) -> RolloutStart:
    base = d.get("base")
    return RolloutStart(
        str(d["model"]),
        RolloutConfig.model_validate(d["config"]),
        int(d.get("step", 0)),
        d.get("phase"),
        None if base is None else tuple((str(p), float(w)) for p, w in base),
    )


def _finished(d: dict[str, Any]) -> Finished:
    work = d["work"]
    ttft = d.get("ttft")
    return Finished(
        d["model"],
        d["id"],
        Outcome(d["outcome"]),
        None if work is None else (work[0], work[1]),
        None if ttft is None else float(ttft),
    )


_EVENT_READERS: Final[dict[str, Callable[[dict[str, Any]], Event]]] = {
    "replicas": lambda d: Replicas(
        d["model"],
        tuple(ReplicaSeen(ReplicaId(i), ReplicaState(s), n) for i, s, n in d["replicas"]),
    ),
    "scraped": lambda d: Scraped(
        d["model"], tuple(ScrapedLoad(ReplicaId(r), n, w, kv) for r, n, w, kv in d["loads"])
    ),
    "probe": lambda d: ProbeAnswered(d["model"], ReplicaId(d["replica"]), bool(d["ok"])),
    "standbys": lambda d: Standbys(
        d["model"], tuple(Standby(ReplicaId(i), bool(r), float(s)) for i, r, s in d["standbys"])
    ),
    "arrived": _arrived,
    "failed": lambda d: AttemptFailed(
        d["model"], d["id"], Outcome(d["outcome"]), bool(d["streamed"])
    ),
    "finished": _finished,
    "gone": lambda d: ClientGone(d["model"], d["id"]),
    "tick": lambda d: Tick(),
    "resident": resident_from_json,
    "weights": lambda d: Weights(
        str(d["model"]), tuple((str(p), float(w)) for p, w in d["weights"])
    ),
    "rollout_start": _rollout_start,
    "rollout_act": lambda d: RolloutAct(str(d["model"]), RolloutAction(d["action"])),
    "latencies": lambda d: Latencies(
        str(d["model"]), tuple(map(float, d["ttft"])), tuple(map(float, d["itl"]))
    ),
    "kv": _kv_events,
    "preempting": lambda d: Preempting(str(d["model"]), ReplicaId(d["replica"]), float(d["at"])),
    "reclaimed": reclaimed_from_json,
    "spot_market": spot_market_from_json,
    "adapter_added": lambda d: AdapterAdded(
        str(d["model"]), str(d["name"]), str(d["path"]), int(d["rank"])
    ),
}


def command_to_json(command: Command) -> dict[str, Any]:  # noqa: PLR0911, PLR0912 - one match
    """The command as a JSON-ready dict: the decision log's line."""
    match command:
        case Route(
            request_id=rid,
            replica=replica,
            retry=retry,
            resume=resume,
            model=model,
            load=load,
            priority=priority,
        ):
            line: dict[str, Any] = {"do": "route", "id": rid, "replica": replica, "retry": retry}
            if resume:  # absent: not a resume (and recordings made before resumes)
                line["resume"] = True
            if model:  # absent: the served name is the pool (and recordings made before)
                line["model"] = model
            if load:  # absent: no adapter to load first
                line["load"] = load
            if priority:  # absent: none sent to the engine
                line["priority"] = priority
            return line
        case Reject(request_id=rid, reason=reason, budget=budget, model=model):
            line = {"do": "reject", "id": rid, "reason": reason, "budget": budget}
            if model:
                line["model"] = model
            return line
        case Fallback(request_id=rid, model=model, to=to, pool=pool, reason=reason):
            return {
                "do": "fallback",
                "id": rid,
                "model": model,
                "to": to,
                "pool": pool,
                "reason": reason,
            }
        case Probe(model=model, replica=replica):
            return {"do": "probe", "model": model, "replica": replica}
        case Ejected(record=r):
            return {
                "do": "eject",
                "model": r.model,
                "replica": r.replica,
                "cause": r.cause.value,
                "enforced": r.enforced,
                "overflow": r.overflow,
                "ejections": r.ejections,
                "duration": r.duration,
            }
        case Scale(decision=decision, view=view, buy=buy):
            line = {"do": "scale", **decision_record(decision, view)}
            if buy:  # absent: the pool's own capacity (and recordings made before)
                line["buy"] = buy
            return line
        case RolloutStep(decision=decision):
            return {"do": "rollout", **decision.to_json()}
        case Sleep():
            return sleep_to_json(command)
        case Wake():
            return wake_to_json(command)
        case KvResync(model=model, replica=replica, from_seq=from_seq):
            return {"do": "kv_resync", "model": model, "replica": replica, "from": from_seq}
        case Abandon(model=model, replica=replica, request_ids=ids):
            return {"do": "abandon", "model": model, "replica": replica, "ids": list(ids)}
        case Recall(model=model, replica=replica, request_id=rid):
            return {"do": "recall", "model": model, "replica": replica, "id": rid}
        case UnloadAdapter(model=model, replica=replica, adapter=adapter):
            return {"do": "unload_adapter", "model": model, "replica": replica, "adapter": adapter}
        case Replace():
            return replace_to_json(command)
    raise TypeError(f"not a command: {command!r}")
