"""The Grafana dashboard of a fleet: the gateway, its autoscaler and the engines, as JSON.

``dashboard()`` builds it as plain data (Grafana's dashboard JSON model, schema 39: Grafana
10 and 11 import it); ``dashboard_json()`` is its one serialisation, shipped as
``deploy/grafana/gpufleet.json`` for any Prometheus-fed Grafana and rendered by
``gpufleet deploy k8s --grafana`` as a ConfigMap that Grafana's dashboard sidecar loads
(label ``grafana_dashboard: "1"``). Every query names metrics the code exports::

    Gateway        requests/s by status, 5xx ratio, routable replicas, pools without N+1
    Latency        TTFT and E2E at the gateway (p50/p90/p99), gateway overhead,
                   ITL at the engines (the gateway does not see tokens)
    Routing        in-flight per replica, routing decisions, upstream attempts by outcome,
                   retries and the retry budget, outlier ejections
    Autoscaler     desired vs current vs ready vs forecast, demand and forecast demand,
                   utilisation and panic, held requests and their outcomes, scale-up lag,
                   which gateway replica leads (operator mode)
    Engines        running / waiting requests, KV-cache usage, then the GPUs of each replica
                   (utilisation, framebuffer memory used, power: dcgm-exporter's names), then
                   prefix-cache hit rate, tokens/s, preemptions, TTFT at the engines

Series from several gateway replicas are summed (counters, in-flight) or maxed (the
autoscaler's gauges: every replica decides, the leader's decision is the one that acts and
all see the same pool). ``$model`` filters the gateway's ``model`` label and the engines'
``model_name`` (the served name is the pool's name). The GPU panels read dcgm-exporter's
series, which carry no model: they keep the pods that also export an engine series of
``$model`` (``and on (pod)``), so one query serves a sim engine (which models them itself) and
a vLLM pod watched by dcgm-exporter.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

Panel = dict[str, Any]

DASHBOARD_UID: Final = "gpufleet-overview"
DASHBOARD_FILE: Final = "gpufleet.json"
_DS: Final = {"type": "prometheus", "uid": "${datasource}"}
_RATE: Final = "$__rate_interval"
_M: Final = 'model=~"$model"'
_E: Final = 'model_name=~"$model"'
_WIDTH: Final = 24


def _target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": _DS, "expr": expr, "legendFormat": legend, "refId": ref}


def _panel(
    title: str,
    targets: Sequence[tuple[str, str]],
    *,
    unit: str = "short",
    description: str = "",
    kind: str = "timeseries",
    stack: bool = False,
    maximum: float | None = None,
) -> Panel:
    defaults: dict[str, Any] = {"unit": unit}
    if maximum is not None:
        defaults["max"] = maximum
    if kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10 if stack else 0,
            "showPoints": "never",
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        }
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": _DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            _target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(targets)
        ],
    }


def _quantiles(metric: str, selector: str, legend: str) -> list[tuple[str, str]]:
    """p50, p90, p99 of a histogram, across every series that matches ``selector``."""
    return [
        (
            f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{selector}}}[{_RATE}])))",
            f"{legend} p{round(q * 100)}",
        )
        for q in (0.5, 0.9, 0.99)
    ]


def _gpus_of_replicas(aggregation: str, metric: str) -> str:
    """``metric`` per engine pod of ``$model``: dcgm-exporter's series carry the pod that holds
    the GPU, not the model, so they are kept where that pod exports a vLLM series of ``$model``."""
    return (
        f"{aggregation} by (pod) ({metric}) "
        f"and on (pod) max by (pod) (vllm:num_requests_running{{{_E}}})"
    )


def _rows() -> list[tuple[str, list[Panel]]]:
    gw = "gpufleet:gateway_"
    auto = "gpufleet:autoscale_"
    gateway = [
        _panel(
            "Requests/s by status",
            [(f"sum by (status) (rate({gw}requests_total{{{_M}}}[{_RATE}]))", "{{status}}")],
            unit="reqps",
            stack=True,
            description="Requests answered by the gateway, by HTTP status.",
        ),
        _panel(
            "5xx ratio",
            [
                (
                    f'sum(rate({gw}requests_total{{{_M},status=~"5.."}}[{_RATE}])) / '
                    f"clamp_min(sum(rate({gw}requests_total{{{_M}}}[{_RATE}])), 1e-9)",
                    "5xx",
                )
            ],
            unit="percentunit",
        ),
        _panel(
            "Routable replicas",
            [(f"max by (model) ({gw}routable_replicas{{{_M}}})", "{{model}}")],
            description="Replicas each pool routes to now (ready, not ejected, not draining).",
        ),
        _panel(
            "Pools without an N+1 spare",
            [(f"max by (model) ({gw}pool_without_spare{{{_M}}})", "{{model}}")],
            description="1 while a pool could not lose a replica without losing capacity.",
            maximum=1,
        ),
    ]
    latency = [
        _panel(
            "Time to first token (gateway)",
            _quantiles(f"{gw}time_to_first_token_seconds", _M, "TTFT"),
            unit="s",
        ),
        _panel(
            "End-to-end latency (gateway)",
            _quantiles(f"{gw}e2e_request_latency_seconds", _M, "E2E"),
            unit="s",
        ),
        _panel(
            "Inter-token latency (engines)",
            _quantiles("vllm:inter_token_latency_seconds", _E, "ITL"),
            unit="s",
        ),
        _panel(
            "Gateway overhead",
            _quantiles(f"{gw}overhead_seconds", _M, "overhead"),
            unit="s",
            description="Gateway time before the first attempt is sent (parse, route).",
        ),
    ]
    routing = [
        _panel(
            "In flight per replica",
            [(f"sum by (replica) ({gw}in_flight_requests)", "{{replica}}")],
            description="Attempts in flight per engine replica, summed over gateway replicas.",
        ),
        _panel(
            "Routing decisions/s",
            [
                (
                    f"sum by (model, policy, panic) "
                    f"(rate({gw}routing_decisions_total{{{_M}}}[{_RATE}]))",
                    "{{model}} {{policy}} panic={{panic}}",
                )
            ],
            unit="ops",
        ),
        _panel(
            "Upstream attempts/s by outcome",
            [
                (
                    f"sum by (outcome) (rate({gw}upstream_attempts_total[{_RATE}]))",
                    "{{outcome}}",
                )
            ],
            unit="ops",
            stack=True,
        ),
        _panel(
            "Retries/s",
            [
                (
                    f"sum by (outcome) (rate({gw}retries_total{{{_M}}}[{_RATE}]))",
                    "retry {{outcome}}",
                ),
                (
                    f"sum(rate({gw}retry_budget_exhausted_total{{{_M}}}[{_RATE}]))",
                    "refused: budget used up",
                ),
            ],
            unit="ops",
        ),
        _panel(
            "Outlier ejections",
            [
                (
                    f"sum by (cause, enforced) (increase({gw}ejections_total{{{_M}}}[{_RATE}]))",
                    "{{cause}} enforced={{enforced}}",
                )
            ],
            description="Ejections per interval (dry-run ones have enforced=false).",
        ),
    ]
    autoscaler = [
        _panel(
            "Replicas: desired vs current vs ready vs forecast",
            [
                (f"max by (model) ({auto}desired_replicas{{{_M}}})", "{{model}} desired"),
                (f"max by (model) ({auto}current_replicas{{{_M}}})", "{{model}} current"),
                (f"max by (model) ({auto}ready_replicas{{{_M}}})", "{{model}} ready"),
                (f"max by (model) ({auto}forecast_replicas{{{_M}}})", "{{model}} forecast"),
                (f"max by (model) ({auto}standby_replicas{{{_M}}})", "{{model}} standby"),
            ],
            description="The autoscaler's last decision and what it saw; current counts "
            "starting replicas, ready those routed to.",
        ),
        _panel(
            "Demand vs forecast (requests/s)",
            [
                (f"max by (model) ({auto}demand{{{_M}}})", "{{model}} demand"),
                (f"max by (model) ({auto}forecast_demand{{{_M}}})", "{{model}} forecast"),
            ],
            unit="reqps",
        ),
        _panel(
            "Utilisation and panic",
            [
                (f"max by (model) ({auto}utilisation{{{_M}}})", "{{model}} stable"),
                (f"max by (model) ({auto}panic_utilisation{{{_M}}})", "{{model}} panic window"),
                (f"max by (model) ({auto}panic{{{_M}}})", "{{model}} in panic"),
            ],
            unit="percentunit",
        ),
        _panel(
            "Held requests",
            [
                (f"sum by (model) ({auto}held_requests{{{_M}}})", "{{model}} held now"),
                (
                    f"sum by (model, outcome) (increase({auto}held_total{{{_M}}}[{_RATE}]))",
                    "{{model}} {{outcome}}",
                ),
            ],
            description="Requests waiting for a replica of a pool with none ready (scale "
            "from zero), and how their waits ended.",
        ),
        _panel(
            "Scaling decisions and actions",
            [
                (
                    f"sum by (model, direction) "
                    f'(increase({auto}decisions_total{{{_M},direction!="hold"}}[{_RATE}]))',
                    "{{model}} {{direction}}",
                ),
                (
                    f"sum by (model, action) (increase({auto}actions_total{{{_M}}}[{_RATE}]))",
                    "{{model}} {{action}}",
                ),
            ],
        ),
        _panel(
            "Scale-up lag p90",
            [
                (
                    f"histogram_quantile(0.9, sum by (le, model) "
                    f"(rate({auto}scale_up_lag_seconds_bucket{{{_M}}}[$__range])))",
                    "{{model}}",
                )
            ],
            unit="s",
            kind="stat",
            description="From a decision to scale up to the pool routing to that many.",
        ),
        _panel(
            "Leader (operator mode)",
            [("max by (pod) (gpufleet:operator_leader)", "{{pod}}")],
            description="1 on the gateway replica that holds the Lease: the one that scales.",
            maximum=1,
        ),
    ]
    engines = [
        _panel(
            "Running requests",
            [(f"sum by (model_name, pod) (vllm:num_requests_running{{{_E}}})", "{{pod}}")],
        ),
        _panel(
            "Waiting requests",
            [(f"sum by (model_name, pod) (vllm:num_requests_waiting{{{_E}}})", "{{pod}}")],
        ),
        _panel(
            "KV-cache usage",
            [(f"max by (model_name, pod) (vllm:kv_cache_usage_perc{{{_E}}})", "{{pod}}")],
            unit="percentunit",
            maximum=1,
        ),
        _panel(
            "GPU utilisation",
            [(_gpus_of_replicas("avg", "DCGM_FI_DEV_GPU_UTIL"), "{{pod}}")],
            unit="percent",
            maximum=100,
            description="Share of recent time the replica's GPUs were busy "
            "(DCGM_FI_DEV_GPU_UTIL, the mean over its GPUs).",
        ),
        _panel(
            "GPU memory used",
            [(_gpus_of_replicas("max", "DCGM_FI_DEV_FB_USED"), "{{pod}}")],
            unit="mbytes",
            description="Framebuffer memory used on the replica's fullest GPU "
            "(DCGM_FI_DEV_FB_USED). A sim engine counts the KV blocks in use; vLLM reserves its "
            "whole KV pool at start, so a real GPU shows it full (docs/sim-engine.md).",
        ),
        _panel(
            "GPU power",
            [(_gpus_of_replicas("sum", "DCGM_FI_DEV_POWER_USAGE"), "{{pod}}")],
            unit="watt",
            description="Power drawn by the replica's GPUs together (DCGM_FI_DEV_POWER_USAGE).",
        ),
        _panel(
            "Prefix-cache hit rate",
            [
                (
                    f"sum by (model_name) (rate(vllm:prefix_cache_hits_total{{{_E}}}[{_RATE}]))"
                    " / clamp_min(sum by (model_name) "
                    f"(rate(vllm:prefix_cache_queries_total{{{_E}}}[{_RATE}])), 1e-9)",
                    "{{model_name}}",
                )
            ],
            unit="percentunit",
            maximum=1,
            description="Prompt tokens found in the prefix cache over prompt tokens looked up.",
        ),
        _panel(
            "Tokens/s",
            [
                (
                    f"sum by (model_name) (rate(vllm:prompt_tokens_total{{{_E}}}[{_RATE}]))",
                    "{{model_name}} prompt",
                ),
                (
                    f"sum by (model_name) (rate(vllm:generation_tokens_total{{{_E}}}[{_RATE}]))",
                    "{{model_name}} generation",
                ),
            ],
        ),
        _panel(
            "Preemptions/s",
            [
                (
                    f"sum by (model_name) (rate(vllm:num_preemptions_total{{{_E}}}[{_RATE}]))",
                    "{{model_name}}",
                )
            ],
            unit="ops",
        ),
        _panel(
            "Time to first token (engines)",
            _quantiles("vllm:time_to_first_token_seconds", _E, "TTFT"),
            unit="s",
        ),
    ]
    return [
        ("Gateway", gateway),
        ("Latency", latency),
        ("Routing and resilience", routing),
        ("Autoscaler", autoscaler),
        ("Engines (vLLM)", engines),
    ]


def dashboard() -> dict[str, Any]:
    """The dashboard, laid out in rows of panels four to a line, with stable ids."""
    panels: list[Panel] = []
    y, next_id = 0, 1
    for title, row in _rows():
        panels.append(
            {
                "type": "row",
                "title": title,
                "id": next_id,
                "collapsed": False,
                "gridPos": {"h": 1, "w": _WIDTH, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id, y = next_id + 1, y + 1
        width = _WIDTH // 4
        for i, panel in enumerate(row):
            panel["id"] = next_id
            panel["gridPos"] = {"h": 8, "w": width, "x": (i % 4) * width, "y": y + (i // 4) * 8}
            panels.append(panel)
            next_id += 1
        y += 8 * ((len(row) + 3) // 4)
    return {
        "uid": DASHBOARD_UID,
        "title": "gpufleet",
        "description": "The gpufleet gateway, its autoscaler and the engines (gpufleet "
        "deploy k8s --grafana; docs/kubernetes.md).",
        "tags": ["gpufleet", "llm", "vllm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "timezone": "",
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "model",
                    "label": "Model",
                    "type": "query",
                    "datasource": _DS,
                    "query": {
                        "query": "label_values(gpufleet:gateway_requests_total, model)",
                        "refId": "models",
                    },
                    "definition": "label_values(gpufleet:gateway_requests_total, model)",
                    "includeAll": True,
                    "allValue": ".*",
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                    "sort": 1,
                    "hide": 0,
                },
            ]
        },
        "panels": panels,
    }


def dashboard_json() -> str:
    """The dashboard as the file ``deploy/grafana/gpufleet.json`` holds it."""
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"
