"""``gpufleet deploy k8s``: the fleet file as Kubernetes manifests, one YAML file per object.

The command reads and validates the fleet file (the same one ``gpufleet up`` serves), hands
the runtime's pools and the file's text to the pure renderer, and writes what it returns.
It talks to no cluster: apply the directory with ``kubectl apply -f DIR``
(docs/kubernetes.md).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from gpufleet.cli._errors import user_errors
from gpufleet.cli._up_cmd import pool_spec
from gpufleet.config import DEFAULT_FLEET, FleetConfig, SpotFallback, load_fleet, node_label
from gpufleet.runtime.kubernetes import (
    GATEWAY_IMAGE,
    VLLM_TAG,
    ClusterFleet,
    SpotPlacement,
    dashboard_json,
    manifest_files,
    notes,
    render,
)

app = typer.Typer(
    help="Render the fleet for a cluster manager, and its Grafana dashboard (writes files; "
    "talks to no cluster).",
    no_args_is_help=True,
)


def cluster_fleet(config: FleetConfig, fleet_yaml: str) -> ClusterFleet:
    """The renderer's input: the runtime's pools, the file as written, the drain time, and
    whether the gateway watches nodes (``runtime.reclaim``: a ClusterRole).

    A stopping replica drains for the gateway's ``first_byte`` timeout: that bounds a whole
    non-streaming answer, so no request the gateway still waits for is cut short. With a
    Redis (``gateway.redis_url``) two gateway pods run, so that losing one loses no service.
    """
    return ClusterFleet(
        pools=tuple(pool_spec(m, config.gateway.seed) for m in config.models),
        fleet_yaml=fleet_yaml,
        drain_s=math.ceil(config.gateway.timeouts.first_byte),
        gateway_replicas=2 if config.gateway.redis_url is not None else 1,
        watch_nodes=config.runtime.reclaim.enabled,
        spot={
            m.name: SpotPlacement(*node_label(spot.node_label), spot.fallback is SpotFallback.WAIT)
            for m in config.models
            if (spot := m.spot_settings) is not None
        },
    )


@app.command("k8s")
def k8s(
    out: Annotated[Path, typer.Option(help="Directory for the manifests (created if needed).")],
    fleet: Annotated[
        Path | None,
        typer.Option(help="Fleet file (YAML); default: the packaged local sim fleet."),
    ] = None,
    namespace: Annotated[
        str | None,
        typer.Option(help="Namespace of every object (default: runtime.namespace, or gpufleet)."),
    ] = None,
    image_tag: Annotated[str, typer.Option(help="Tag of the vllm/vllm-openai image.")] = VLLM_TAG,
    gateway_image: Annotated[
        str, typer.Option(help="The gpufleet image (gateway and sim engines).")
    ] = GATEWAY_IMAGE,
    servicemonitor: Annotated[
        bool, typer.Option(help="Also write Prometheus Operator ServiceMonitors.")
    ] = False,
    grafana: Annotated[
        bool,
        typer.Option(
            help="Also write the Grafana dashboard as a ConfigMap for Grafana's sidecar "
            '(label grafana_dashboard: "1").'
        ),
    ] = False,
) -> None:
    """Write Kubernetes manifests for a fleet file: one YAML file per object into --out.

    Example: gpufleet deploy k8s --fleet examples/local-sim.yaml --out k8s/
    """
    with user_errors():
        path = fleet or DEFAULT_FLEET
        config = load_fleet(path)
        if config.gateway.tls is not None:
            raise ValueError(
                "gateway.tls: not rendered for Kubernetes (the pod would mount no certificate "
                "and its probes speak HTTP); terminate TLS at an Ingress or a load balancer "
                "and leave gateway.tls out of this file"
            )
        wanted = config.runtime.namespace
        if namespace is not None and wanted is not None and namespace != wanted:
            raise ValueError(
                f"--namespace {namespace} contradicts the fleet file's runtime.namespace {wanted}"
            )
        namespace = namespace or wanted or "gpufleet"
        spec = cluster_fleet(config, path.read_text())
        objects = render(
            spec,
            namespace,
            image_tag,
            gateway_image=gateway_image,
            service_monitor=servicemonitor,
            grafana=grafana,
        )
        files = manifest_files(objects)
        try:
            out.mkdir(parents=True, exist_ok=True)
            stale = sorted(
                p.name for p in out.glob("*.yaml") if p.name not in {name for name, _ in files}
            )
            for name, text in files:
                (out / name).write_text(text)
        except OSError as error:
            raise ValueError(f"{out}: cannot write: {error.strerror or error}") from None
    for line in notes(spec):
        typer.echo(f"note: {line}")
    if not config.tenants.auth and not config.tenants.auth_written:
        typer.echo(
            "note: the gateway pod listens on 0.0.0.0, so it requires API keys (tenants.auth "
            "is not written); write `tenants.auth: false` to serve without them"
        )
    typer.echo(f"wrote {len(files)} manifest(s) to {out} (namespace {namespace})")
    if stale:
        typer.echo(
            f"warning: {out} also holds {len(stale)} other YAML file(s) that "
            f"`kubectl apply -f {out}` would apply too: {', '.join(stale)}"
        )


@app.command("grafana")
def grafana_dashboard(
    out: Annotated[
        Path, typer.Option(help="File to write the dashboard JSON to (- for stdout).")
    ] = Path("-"),
) -> None:
    """Write the Grafana dashboard (gateway, autoscaler, engines) for import into any Grafana
    fed by Prometheus; the same as deploy/grafana/gpufleet.json.

    Example: gpufleet deploy grafana --out gpufleet.json
    """
    text = dashboard_json()
    if str(out) == "-":
        typer.echo(text, nl=False)
        return
    with user_errors():
        try:
            out.write_text(text)
        except OSError as error:
            raise ValueError(f"{out}: cannot write: {error.strerror or error}") from None
    typer.echo(f"wrote the dashboard to {out} (import it in Grafana: Dashboards > Import)")
