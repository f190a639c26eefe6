"""The control loop, written once: a sans-I/O pool controller per model pool.

The gateway (HTTP and asyncio timers) and the fleet simulator (a virtual clock) turn what
happens into :mod:`events <gpufleet.control._events>` and carry out the commands that come
back; every rule between them and the policies (``gpufleet.policy``) lives here
(docs/architecture.md). ``gpufleet up --record`` writes the events, ``gpufleet replay``
feeds them to a fresh controller.
"""

from gpufleet.control._events import (
    Arrived,
    AttemptFailed,
    ClientGone,
    Command,
    Ejected,
    Event,
    Finished,
    Probe,
    ProbeAnswered,
    Reject,
    RejectReason,
    Replicas,
    ReplicaSeen,
    Route,
    Scale,
    Scraped,
    ScrapedLoad,
    Standbys,
    Tick,
    command_to_json,
    event_from_json,
    event_to_json,
)
from gpufleet.control._fleet import (
    DecisionLog,
    FleetController,
    Recorded,
    read_recording,
    replay,
)
from gpufleet.control._pool import ANONYMOUS, PoolController, PoolCounters
from gpufleet.control._settings import PoolSettings

__all__ = [
    "ANONYMOUS",
    "Arrived",
    "AttemptFailed",
    "ClientGone",
    "Command",
    "DecisionLog",
    "Ejected",
    "Event",
    "Finished",
    "FleetController",
    "PoolController",
    "PoolCounters",
    "PoolSettings",
    "Probe",
    "ProbeAnswered",
    "Recorded",
    "Reject",
    "RejectReason",
    "ReplicaSeen",
    "Replicas",
    "Route",
    "Scale",
    "Scraped",
    "ScrapedLoad",
    "Standbys",
    "Tick",
    "command_to_json",
    "event_from_json",
    "event_to_json",
    "read_recording",
    "replay",
]
