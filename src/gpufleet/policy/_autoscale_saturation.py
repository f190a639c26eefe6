"""Saturation: how close one replica is to what bounds it, defined once for the control plane.

A replica is bounded by whichever of its resources runs out first — KV-cache blocks or the
running-batch cap ``max_num_seqs`` — not by GPU busy time (a decode-bound GPU is "100 %
busy" at any batch size). Requests it cannot admit wait in its queue. So::

    binding  = max(kv_cache_usage, running / max_num_seqs)          0 … 1: what it holds
    capacity = running / binding   (max_num_seqs when nothing runs)  seqs it could hold
    queue    = (running + waiting) / capacity                        demand over capacity

    saturation = max(kv_cache_usage, running / max_num_seqs, queue)

``queue`` equals ``binding`` when nothing waits and grows past 1 with the queue, in the
binding resource's unit: 40 running at 95 % KV with 20 waiting is 0.95 × 60 / 40 ≈ 1.43,
"needs 1.43 replicas". A request waiting for a moment at low load moves it little
(1 running + 1 waiting at 1 % KV is 0.02). A replica never scraped is judged by the
gateway's own count, ``in_flight / max_num_seqs``.

This is THE shared definition: the autoscaler sizes pools on the mean over ready replicas
(:func:`pool_utilisation`), and routing and admission should rank and shed on the same
number rather than define their own.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpufleet.fleet import ROUTABLE, ReplicaLoad, ReplicaView


def saturation(load: ReplicaLoad, max_num_seqs: int) -> float:
    """One replica's saturation (≥ 0; above 1 when requests queue); see the module doc."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    if load.observed_at is None:
        return load.in_flight / max_num_seqs
    seqs = load.running / max_num_seqs
    binding = max(load.kv_cache_usage, seqs)
    capacity = load.running / binding if load.running > 0 and binding > 0.0 else max_num_seqs
    queue = (load.running + load.waiting) / capacity
    return max(load.kv_cache_usage, seqs, queue)


def pool_utilisation(replicas: Iterable[ReplicaView], max_num_seqs: int) -> float | None:
    """Mean saturation over the pool's ready (``ROUTABLE``) replicas; ``None`` without one."""
    values = [saturation(r.load, max_num_seqs) for r in replicas if r.state in ROUTABLE]
    return sum(values) / len(values) if values else None
