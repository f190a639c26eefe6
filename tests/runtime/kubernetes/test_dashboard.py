"""The Grafana dashboard: every metric it queries is one the code exports; the shipped file is
what the code builds; the ConfigMap is labelled for Grafana's sidecar and validates.

What the code exports is read from the real objects: the gateway's and the autoscaler's
metric classes, the operator's leader gauge, and the ``/metrics`` page of a real sim engine
(which speaks vLLM's metric names), each family expanded to the sample names Prometheus
stores (``_total`` for counters, ``_bucket``/``_sum``/``_count`` for histograms).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from gpufleet.cli import app
from gpufleet.gateway._autoscale import AutoscaleMetrics
from gpufleet.gateway._metrics import GatewayMetrics
from gpufleet.runtime.kubernetes import (
    DASHBOARD_FILE,
    DASHBOARDS,
    GRAFANA_LABEL,
    KubernetesRuntime,
    dashboard,
    dashboard_json,
    export_leadership,
    render,
)

from .cluster import sim_pod
from .conftest import REPO, fleet_from

SHIPPED = REPO / "deploy" / "grafana" / DASHBOARD_FILE

# PromQL words a query may use that are not metric names (functions, aggregations, keywords)
PROMQL_WORDS = {
    "sum",
    "max",
    "min",
    "avg",
    "by",
    "without",
    "rate",
    "increase",
    "histogram_quantile",
    "clamp_min",
    "on",
    "ignoring",
    "group_left",
    "and",
    "or",
    "unless",
}


class _Leading:
    leading = True


def _sample_names(families: Any) -> set[str]:
    names = set()
    for family in families:
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("_sum", "_count", ""),
        }.get(family.type, ("",))
        names |= {family.name + suffix for suffix in suffixes}
    return names


@pytest.fixture(scope="module")
def exported() -> set[str]:
    registry = CollectorRegistry()
    GatewayMetrics(registry)
    AutoscaleMetrics(registry)
    export_leadership(cast(KubernetesRuntime, _Leading()), registry)
    return _sample_names(registry.collect())


async def _engine_metrics() -> set[str]:
    async with sim_pod() as port, httpx.AsyncClient() as client:
        text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    return _sample_names(text_string_to_metric_families(text))


def _queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, and the template variables' queries."""
    found = [
        (panel["title"], target["expr"])
        for panel in board["panels"]
        for target in panel.get("targets", [])
    ]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            found.append((f"${var['name']}", var["query"]["query"]))
    return found


def _metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads; ``AssertionError`` on a bare word that is
    neither a metric (ours and vLLM's all have a ``:``, dcgm-exporter's start ``DCGM_FI_``)
    nor PromQL."""
    text = re.sub(r'"[^"]*"', "", expr)  # strings: matcher values, label_values' args
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left)\s*\([^)]*\)", r"\1", text)  # labels
    text = re.sub(r"label_values\(([^,]+),[^)]*\)", r"\1", text)  # its label argument
    text = re.sub(r"\b\d+(\.\d+)?(e-?\d+)?\b", "", text)  # numbers (1e-9)
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_:]*", text))
    metrics = {w for w in words if ":" in w or w.startswith("DCGM_FI_")}
    unknown = words - metrics - PROMQL_WORDS
    assert not unknown, f"{expr}: {sorted(unknown)} are neither metrics nor PromQL"
    return metrics


@pytest.mark.asyncio
async def test_every_metric_a_panel_queries_is_one_the_code_exports(exported: set[str]) -> None:
    known = exported | await _engine_metrics()
    board = dashboard()
    queried: dict[str, set[str]] = {}
    for title, expr in _queries(board):
        assert expr.count("(") == expr.count(")"), expr
        for name in _metric_names(expr):
            queried.setdefault(name, set()).add(title)
    missing = {name: titles for name, titles in queried.items() if name not in known}
    assert not missing, f"queried but not exported: {missing}"
    # and the dashboard covers what the issue asks for
    for wanted in (
        "gpufleet:gateway_requests_total",
        "gpufleet:gateway_time_to_first_token_seconds_bucket",
        "gpufleet:gateway_e2e_request_latency_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "gpufleet:gateway_in_flight_requests",
        "gpufleet:gateway_routing_decisions_total",
        "gpufleet:gateway_retries_total",
        "gpufleet:gateway_ejections_total",
        "gpufleet:autoscale_desired_replicas",
        "gpufleet:autoscale_current_replicas",
        "gpufleet:autoscale_forecast_replicas",
        "gpufleet:autoscale_held_requests",
        "gpufleet:operator_leader",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_POWER_USAGE",
    ):
        assert wanted in queried, wanted
    print(f"\n{len(_queries(board))} queries read {len(queried)} metrics, all exported")


def test_the_parser_catches_a_misspelt_metric() -> None:
    assert _metric_names('sum by (le) (rate(vllm:x_bucket{a="b:c"}[5m]))') == {"vllm:x_bucket"}
    assert _metric_names("avg by (pod) (DCGM_FI_DEV_GPU_UTIL) and on (pod) vllm:x") == {
        "DCGM_FI_DEV_GPU_UTIL",
        "vllm:x",
    }
    with pytest.raises(AssertionError, match="neither metrics nor PromQL"):
        _metric_names("sum(rate(gateway_requests_total[5m]))")  # no namespace: not ours
    with pytest.raises(AssertionError, match="neither metrics nor PromQL"):
        _metric_names("avg(DCGM_DEV_GPU_UTIL)")  # dcgm-exporter's names all start DCGM_FI_


def test_the_gpu_panels_sit_by_queue_and_kv_fill_and_keep_the_pods_of_the_model() -> None:
    board = dashboard()
    engines = [p for p in board["panels"] if p["type"] != "row"][-10:]
    titles = [p["title"] for p in engines]
    assert titles[:6] == [
        "Running requests",
        "Waiting requests",
        "KV-cache usage",
        "GPU utilisation",
        "GPU memory used",
        "GPU power",
    ]
    units = {"GPU utilisation": "percent", "GPU memory used": "mbytes", "GPU power": "watt"}
    for panel in engines[3:6]:
        assert panel["fieldConfig"]["defaults"]["unit"] == units[panel["title"]]
        (target,) = panel["targets"]
        assert target["legendFormat"] == "{{pod}}"
        # per replica (pod), and only the pods that serve $model: dcgm-exporter has no model
        expr = target["expr"]
        assert re.match(r"(avg|max|sum) by \(pod\) \(DCGM_FI_DEV_\w+\) and on \(pod\) ", expr)
        assert 'model_name=~"$model"' in expr


def test_panels_have_unique_ids_sane_layout_and_the_datasource_variable() -> None:
    board = dashboard()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        area = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not area & cells, panel["title"]  # no two panels overlap
        cells |= area
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
            assert target["refId"]
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == ["Gateway", "Latency", "Routing and resilience", "Autoscaler", "Engines (vLLM)"]
    variables = {v["name"] for v in board["templating"]["list"]}
    assert variables == {"datasource", "model"}


def test_the_shipped_file_is_what_the_code_builds() -> None:
    assert SHIPPED.read_text() == dashboard_json(), (
        "regenerate it: gpufleet deploy grafana --out deploy/grafana/gpufleet.json"
    )


def test_the_configmap_carries_the_dashboard_for_grafanas_sidecar() -> None:
    path = REPO / "examples" / "local-sim.yaml"
    objects = render(fleet_from(path), "ml", grafana=True)
    assert DASHBOARDS not in {o["metadata"]["name"] for o in render(fleet_from(path), "ml")}
    configmap = objects[-1]
    assert (configmap["kind"], configmap["metadata"]["name"]) == ("ConfigMap", DASHBOARDS)
    assert configmap["metadata"]["namespace"] == "ml"
    assert configmap["metadata"]["labels"][GRAFANA_LABEL] == "1"
    assert json.loads(configmap["data"][DASHBOARD_FILE]) == dashboard()
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(configmap, "1.37", strict=True)


def test_deploy_writes_the_configmap_and_the_dashboard_file(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "k8s"
    result = runner.invoke(app, ["deploy", "k8s", "--out", str(out), "--grafana"])
    assert result.exit_code == 0, result.output
    (written,) = out.glob(f"*-configmap-{DASHBOARDS}.yaml")
    assert json.loads(yaml.safe_load(written.read_text())["data"][DASHBOARD_FILE]) == dashboard()
    result = runner.invoke(app, ["deploy", "grafana"])
    assert result.exit_code == 0, result.output
    assert result.stdout == dashboard_json()
    result = runner.invoke(app, ["deploy", "grafana", "--out", str(tmp_path / "d.json")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "d.json").read_text() == dashboard_json()
