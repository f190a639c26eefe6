"""``render``: every object is valid Kubernetes, and says what the fleet file says.

Schema validation uses kubernetes-validate's offline OpenAPI schemas (strict: unknown fields
fail). No cluster runs here; docs/kubernetes.md says how to apply the manifests to one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpufleet.catalog import load_gpus
from gpufleet.config import load_fleet, parse_fleet
from gpufleet.runtime import EngineKind, EngineSpec, PoolSpec
from gpufleet.runtime.kubernetes import (
    FLEET_KEY,
    GATEWAY,
    GPU_PRODUCT_LABEL,
    GPU_PRODUCTS,
    GPU_RESOURCE,
    SPOT_TOLERATIONS,
    ClusterFleet,
    Manifest,
    gpu_product,
    manifest_files,
    notes,
    pool_object_names,
    render,
)

from .conftest import FLEET_FILES, fleet_from

KUBERNETES_VERSIONS = ["1.30", "1.37"]
"""The oldest release the manifests target and the newest kubernetes-validate knows."""


def _find(objects: Sequence[Manifest], kind: str, name: str) -> Manifest:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _container(deployment: Manifest) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def _check_service_monitor(obj: Manifest) -> None:
    """ServiceMonitor is a CRD (Prometheus Operator): no schema in Kubernetes' OpenAPI, so
    its shape is checked here, field by field, against the CRD's documented fields."""
    assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(obj["spec"]) == {"selector", "namespaceSelector", "endpoints"}
    assert obj["spec"]["selector"]["matchLabels"]
    for endpoint in obj["spec"]["endpoints"]:
        assert set(endpoint) == {"port", "path", "interval"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", FLEET_FILES, ids=lambda p: p.name)
def test_every_object_of_every_shipped_fleet_validates(path: Path, version: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objects = render(fleet_from(path), service_monitor=True, grafana=True)
    for obj in objects:
        # round-trip through the YAML we write, so what is validated is what is applied
        data = yaml.safe_load(manifest_files([obj])[0][1])
        if data["kind"] == "ServiceMonitor":
            _check_service_monitor(data)
        else:
            kubernetes_validate.validate(data, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_of_a_gpu_fleet_validates(gpu_fleet: ClusterFleet, version: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for obj in render(gpu_fleet, "inference", "v0.18.0", service_monitor=True, grafana=True):
        data = yaml.safe_load(manifest_files([obj])[0][1])
        if data["kind"] == "ServiceMonitor":
            _check_service_monitor(data)
        else:
            kubernetes_validate.validate(data, version, strict=True)


def test_objects_come_in_apply_order_with_stable_names(gpu_fleet: ClusterFleet) -> None:
    objects = render(gpu_fleet, "inference")
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("Namespace", "inference"),
        ("ServiceAccount", GATEWAY),
        ("Role", GATEWAY),
        ("RoleBinding", GATEWAY),
        ("ClusterRole", f"{GATEWAY}-inference"),
        ("ClusterRoleBinding", f"{GATEWAY}-inference"),
        ("ConfigMap", GATEWAY),
        ("Deployment", GATEWAY),
        ("Service", GATEWAY),
        ("Deployment", "llama-3-1-70b"),
        ("Service", "llama-3-1-70b"),
        ("PodDisruptionBudget", "llama-3-1-70b"),
        ("Deployment", "qwen2-5-7b"),
        ("Service", "qwen2-5-7b"),
        ("PodDisruptionBudget", "qwen2-5-7b"),
        ("Deployment", "llama-3-1-8b"),
        ("Service", "llama-3-1-8b"),
        ("PodDisruptionBudget", "llama-3-1-8b"),
    ]
    assert all(o["metadata"].get("namespace", "inference") == "inference" for o in objects)
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    assert all(("namespace" in o["metadata"]) == (o["kind"] not in cluster_scoped) for o in objects)


def test_vllm_pool_asks_for_tp_gpus_of_its_type_and_tolerates_their_taint(
    gpu_fleet: ClusterFleet,
) -> None:
    objects = render(gpu_fleet)
    for name, tp, label in [
        ("llama-3-1-70b", 4, "NVIDIA-H100-80GB-HBM3"),
        ("qwen2-5-7b", 1, "NVIDIA-L40S"),
    ]:
        deployment = _find(objects, "Deployment", name)
        pod = deployment["spec"]["template"]["spec"]
        assert _container(deployment)["resources"]["limits"] == {GPU_RESOURCE: tp}
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"] == [
            {"matchExpressions": [{"key": GPU_PRODUCT_LABEL, "operator": "In", "values": [label]}]}
        ]
        assert {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]
        shm = {v["name"]: v for v in pod["volumes"]}["dshm"]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in _container(deployment)["volumeMounts"]


def test_vllm_args_come_from_the_fleet_file_and_end_with_its_profile(
    gpu_fleet: ClusterFleet,
) -> None:
    container = _container(
        _find(render(gpu_fleet, image_tag="v0.19.1"), "Deployment", "llama-3-1-70b")
    )
    assert container["image"] == "vllm/vllm-openai:v0.19.1"
    assert container["command"] == ["vllm", "serve"]
    args = container["args"]
    assert args[0] == "meta-llama/Llama-3.1-70B-Instruct"
    assert args[1:9] == [
        *("--host", "0.0.0.0", "--port", "8000"),
        *("--served-model-name", "llama-3.1-70b"),
        *("--shutdown-timeout", "120"),  # the fleet's first_byte timeout
    ]
    assert args[9:] == [  # the profile: `tp`, then the file's args, each flag once; the seed
        *("--tensor-parallel-size", "4", "--max-model-len", "8192"),
        *("--gpu-memory-utilization", "0.92", "--enable-prefix-caching", "--seed", "0"),
    ]


def test_engine_fields_of_the_fleet_file_become_vllm_flags_env_and_startup_budget(
    tmp_path: Path,
) -> None:
    path = tmp_path / "fields.yaml"
    path.write_text(
        "models:\n"
        "  - {name: qwen, model: Qwen/Qwen2.5-7B-Instruct, engine: vllm, gpu: l40s,\n"
        "     gpu_memory_utilization: 0.8, max_model_len: 16384, prefix_caching: false,\n"
        "     startup: {timeout: 2400}, env: {VLLM_LOGGING_LEVEL: DEBUG}}\n"
    )
    container = _container(_find(render(fleet_from(path)), "Deployment", "qwen"))
    args = container["args"]
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.8"
    assert args[args.index("--max-model-len") + 1] == "16384"
    assert "--no-enable-prefix-caching" in args
    assert "--enable-prefix-caching" not in args
    assert {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"} in container["env"]
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 2400


def test_drain_fits_in_the_grace_period_and_probes_give_model_load_minutes(
    gpu_fleet: ClusterFleet,
) -> None:
    deployment = _find(render(gpu_fleet), "Deployment", "llama-3-1-70b")
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + gpu_fleet.drain_s
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}


def test_pdb_and_headless_service_select_exactly_the_pools_pods(gpu_fleet: ClusterFleet) -> None:
    objects = render(gpu_fleet)
    pools = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] != GATEWAY]
    for deployment in pools:
        name = deployment["metadata"]["name"]
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        pdb = _find(objects, "PodDisruptionBudget", name)
        service = _find(objects, "Service", name)
        for selector in (pdb["spec"]["selector"]["matchLabels"], service["spec"]["selector"]):
            assert selector == deployment["spec"]["selector"]["matchLabels"]
            assert selector.items() <= pod_labels.items()
            # and no other pool's pods
            for other in pools:
                if other is not deployment:
                    others = other["spec"]["template"]["metadata"]["labels"]
                    assert not selector.items() <= others.items()
        assert service["spec"]["clusterIP"] == "None"
        assert pdb["spec"]["maxUnavailable"] == 1


def test_sim_pool_runs_the_gpufleet_image_without_a_gpu(gpu_fleet: ClusterFleet) -> None:
    deployment = _find(
        render(gpu_fleet, gateway_image="registry.example/gpufleet:1"), "Deployment", "llama-3-1-8b"
    )
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    assert container["image"] == "registry.example/gpufleet:1"
    assert container["command"] == ["gpufleet", "engine", "sim"]
    assert "resources" not in container
    assert "affinity" not in pod
    assert "tolerations" not in pod
    assert deployment["spec"]["replicas"] == 2


def test_external_pools_render_nothing_but_a_note(gpu_fleet: ClusterFleet) -> None:
    names = {o["metadata"]["name"] for o in render(gpu_fleet)}
    assert not any("partner" in name for name in names)
    assert notes(gpu_fleet) == [
        "partner: external (http://10.0.0.5:8000): nothing rendered, "
        "the gateway routes to these endpoints"
    ]


def test_gateway_role_has_exactly_the_rights_it_needs(gpu_fleet: ClusterFleet) -> None:
    role = _find(render(gpu_fleet), "Role", GATEWAY)
    # operator mode's calls, no more (test_operator.py checks every call it makes is allowed)
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["list", "watch"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": ["llama-3-1-70b", "qwen2-5-7b", "llama-3-1-8b"],
            "verbs": ["get", "patch"],
        },
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": [GATEWAY],
            "verbs": ["get", "update"],
        },
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    ]
    binding = _find(render(gpu_fleet), "RoleBinding", GATEWAY)
    assert binding["roleRef"]["name"] == GATEWAY
    assert binding["subjects"][0]["name"] == GATEWAY


def test_the_node_watch_gets_read_access_to_nodes_and_nothing_else_of_the_cluster(
    gpu_fleet: ClusterFleet,
) -> None:
    objects = render(gpu_fleet, "inference")
    role = _find(objects, "ClusterRole", "gpufleet-gateway-inference")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]}
    ]
    binding = _find(objects, "ClusterRoleBinding", "gpufleet-gateway-inference")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "gpufleet-gateway-inference",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": GATEWAY, "namespace": "inference"}
    ]
    # cluster-scoped: one per namespace, so two fleets in two namespaces do not collide
    other = render(gpu_fleet, "staging")
    assert _find(other, "ClusterRole", "gpufleet-gateway-staging")
    assert (
        _find(other, "ClusterRoleBinding", "gpufleet-gateway-staging")["subjects"][0]["namespace"]
        == "staging"
    )


def test_no_cluster_role_when_the_fleet_file_turns_the_node_watch_off(
    gpu_fleet_file: Path,
) -> None:
    text = gpu_fleet_file.read_text() + "runtime: {reclaim: {enabled: false}}\n"
    gpu_fleet_file.write_text(text)
    kinds = {o["kind"] for o in render(fleet_from(gpu_fleet_file))}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}
    assert {"Role", "RoleBinding"} <= kinds


def test_gateway_serves_the_fleet_file_from_its_configmap_and_probes_health_and_ready(
    gpu_fleet: ClusterFleet,
) -> None:
    objects = render(gpu_fleet)
    deployment = _find(objects, "Deployment", GATEWAY)
    container = _container(deployment)
    assert deployment["spec"]["replicas"] == 1  # no Redis in the fleet file
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    mount = container["volumeMounts"][0]
    assert container["args"][:2] == ["--fleet", f"{mount['mountPath']}/{FLEET_KEY}"]
    assert container["args"][-2:] == ["--runtime", "kubernetes"]  # operator mode
    volume = deployment["spec"]["template"]["spec"]["volumes"][0]
    assert volume == {"name": mount["name"], "configMap": {"name": GATEWAY}}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == GATEWAY


def test_a_fleet_with_redis_runs_two_gateways(gpu_fleet_file: Path) -> None:
    text = gpu_fleet_file.read_text().replace(
        "gateway:\n", "gateway:\n  redis_url: redis://redis:6379/0\n"
    )
    gpu_fleet_file.write_text(text)
    deployment = _find(render(fleet_from(gpu_fleet_file)), "Deployment", GATEWAY)
    assert deployment["spec"]["replicas"] == 2


@pytest.mark.parametrize("path", FLEET_FILES, ids=lambda p: p.name)
def test_configmap_round_trips_to_the_same_fleet(path: Path) -> None:
    ((_, text),) = [f for f in manifest_files(render(fleet_from(path))) if "configmap" in f[0]]
    stored = yaml.safe_load(text)["data"][FLEET_KEY]
    assert parse_fleet(yaml.safe_load(stored)) == load_fleet(path)
    assert stored == path.read_text()  # comments and all


@pytest.mark.parametrize("path", FLEET_FILES, ids=lambda p: p.name)
def test_rendering_twice_gives_identical_bytes(path: Path) -> None:
    first = manifest_files(render(fleet_from(path), service_monitor=True, grafana=True))
    second = manifest_files(render(fleet_from(path), service_monitor=True, grafana=True))
    assert first == second
    assert len({name for name, _ in first}) == len(first)
    assert [name for name, _ in first] == sorted(name for name, _ in first)


def test_a_changed_fleet_file_rolls_the_gateway(gpu_fleet: ClusterFleet) -> None:
    def annotations(fleet: ClusterFleet) -> dict[str, str]:
        deployment = _find(render(fleet), "Deployment", GATEWAY)
        result: dict[str, str] = deployment["spec"]["template"]["metadata"]["annotations"]
        return result

    changed = ClusterFleet(gpu_fleet.pools, gpu_fleet.fleet_yaml + "# edited\n")
    assert annotations(changed) != annotations(gpu_fleet)


def test_every_nvidia_catalog_gpu_has_a_node_label() -> None:
    nvidia = {name for name, g in load_gpus().items() if g.vendor == "nvidia"}
    assert nvidia <= set(GPU_PRODUCTS)
    assert all(" " not in label and label.startswith("NVIDIA-") for label in GPU_PRODUCTS.values())
    assert gpu_product("h100-sxm") == "NVIDIA-H100-80GB-HBM3"
    with pytest.raises(ValueError, match="mi300x"):
        gpu_product("mi300x")


def test_pool_names_become_dns_labels_and_collisions_are_refused() -> None:
    def pool(name: str) -> PoolSpec:
        return PoolSpec(name, EngineSpec(kind=EngineKind.SIM), replicas=1)

    long = "m" + "-x" * 40
    names = pool_object_names([pool("llama-3.1-8b"), pool("7b.chat"), pool(long)])
    assert names["llama-3.1-8b"] == "llama-3-1-8b"
    assert names["7b.chat"] == "pool-7b-chat"
    assert len(names[long]) <= 63
    assert names[long] == pool_object_names([pool(long)])[long]
    with pytest.raises(ValueError, match="already taken"):
        pool_object_names([pool("a.b"), pool("a-b")])
    with pytest.raises(ValueError, match="already taken"):
        pool_object_names([pool("gpufleet-gateway")])


def test_bad_namespace_and_unknown_gpu_label_are_value_errors(gpu_fleet: ClusterFleet) -> None:
    with pytest.raises(ValueError, match="namespace"):
        render(gpu_fleet, "Not_A_Label")
    amd = PoolSpec("big", EngineSpec(model="x/y", kind=EngineKind.VLLM, gpu="mi300x"), replicas=1)
    with pytest.raises(ValueError, match="mi300x"):
        render(ClusterFleet((amd,), "models: []\n"))


SPOT_FLEET = """\
models:
  - name: llama-od
    model: meta-llama/Llama-3.1-8B-Instruct
    engine: vllm
    gpu: l40s
  - name: llama-spot-wait
    model: meta-llama/Llama-3.1-8B-Instruct
    engine: vllm
    gpu: l40s
    capacity: spot
  - name: llama-spot-fallback
    model: meta-llama/Llama-3.1-8B-Instruct
    engine: vllm
    gpu: l40s
    capacity: spot
    spot: {fallback: on_demand, node_label: cloud.google.com/gke-spot=true}
  - name: sim-spot
    model: llama-3.1-8b
    engine: sim
    capacity: spot
"""


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_spot_pools_require_or_prefer_spot_nodes_as_their_fallback_says(
    tmp_path: Path, version: str
) -> None:
    """``spot.fallback: wait``: the pods require spot nodes (none to be had: they wait,
    Pending); ``on_demand``: they prefer them, so the scheduler and the node provisioner
    place them on other nodes when no spot node can be had. Both tolerate the clouds'
    spot taints; an on-demand pool is left as it was."""
    path = tmp_path / "spot.yaml"
    path.write_text(SPOT_FLEET)
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objects = render(fleet_from(path))
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)

    def pod(name: str) -> dict[str, Any]:
        spec: dict[str, Any] = _find(objects, "Deployment", name)["spec"]["template"]["spec"]
        return spec

    gpu = {"key": GPU_PRODUCT_LABEL, "operator": "In", "values": ["NVIDIA-L40S"]}
    karpenter = {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["spot"]}
    waits = pod("llama-spot-wait")["affinity"]["nodeAffinity"]
    assert waits["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchExpressions": [gpu, karpenter]}
    ]
    assert "preferredDuringSchedulingIgnoredDuringExecution" not in waits
    falls_back = pod("llama-spot-fallback")["affinity"]["nodeAffinity"]
    assert falls_back["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchExpressions": [gpu]}
    ]
    gke = {"key": "cloud.google.com/gke-spot", "operator": "In", "values": ["true"]}
    assert falls_back["preferredDuringSchedulingIgnoredDuringExecution"] == [
        {"weight": 100, "preference": {"matchExpressions": [gke]}}
    ]
    sim = pod("sim-spot")["affinity"]["nodeAffinity"]  # no GPU term: the spot one alone
    assert sim["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchExpressions": [karpenter]}
    ]
    for name in ("llama-spot-wait", "llama-spot-fallback", "sim-spot"):
        assert all(t in pod(name)["tolerations"] for t in SPOT_TOLERATIONS)
    on_demand = pod("llama-od")
    assert (
        "preferredDuringSchedulingIgnoredDuringExecution"
        not in on_demand["affinity"]["nodeAffinity"]
    )
    assert not any(t in on_demand["tolerations"] for t in SPOT_TOLERATIONS)


@pytest.mark.parametrize("label", ["spot", "=spot", "karpenter.sh/capacity-type=sp ot"])
def test_a_spot_node_label_that_is_no_label_is_a_fleet_file_error(label: str) -> None:
    model = {"name": "m", "capacity": "spot", "spot": {"node_label": label}}
    with pytest.raises(ValueError, match="is not a node label"):
        parse_fleet({"models": [model]})
