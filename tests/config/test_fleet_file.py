"""The fleet file: defaults, the shipped files, and errors that name the field."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

import gpufleet.config as package
from gpufleet.config import (
    DEFAULT_FLEET,
    STARTUP_TIMEOUTS,
    EngineKind,
    FleetFileError,
    TenantsConfig,
    is_loopback,
    load_fleet,
    parse_fleet,
)
from gpufleet.fleet import ReplicaProfile
from gpufleet.policy import KVAwareConfig, PrefixAwareConfig, RoundRobinConfig

EXAMPLES = Path(__file__).parents[2] / "examples"


def test_all_matches_public_names() -> None:
    public = {
        attr
        for attr, value in vars(package).items()
        if not attr.startswith("_")
        and not isinstance(value, types.ModuleType)
        and attr != "annotations"
    }
    assert set(package.__all__) == public
    assert list(package.__all__) == sorted(package.__all__, key=lambda n: (not n.isupper(), n))


def test_default_fleet_is_a_small_local_sim_fleet() -> None:
    fleet = load_fleet()
    assert load_fleet(DEFAULT_FLEET) == fleet
    assert (fleet.gateway.host, fleet.gateway.port) == ("127.0.0.1", 8000)
    (model,) = fleet.models
    assert (model.name, model.engine, model.gpu, model.replica_count) == (
        "llama-3.1-8b",
        EngineKind.SIM,
        "h100-sxm",
        2,
    )
    assert isinstance(model.routing, PrefixAwareConfig)


def test_example_local_sim_loads() -> None:
    fleet = load_fleet(EXAMPLES / "local-sim.yaml")
    assert [m.name for m in fleet.models] == ["llama-3.1-8b", "qwen2.5-7b"]
    assert fleet.models[0].replica_count == 3
    assert isinstance(fleet.models[1].routing, KVAwareConfig)


def test_minimal_file_takes_every_default() -> None:
    fleet = parse_fleet({"models": [{"name": "llama-3.1-8b"}]})
    model = fleet.models[0]
    assert model.served_model == "llama-3.1-8b"
    assert model.replica_count == 2
    assert fleet.gateway.timeouts.connect > 0
    assert fleet.gateway.scrape_interval == 0.2


def test_routing_by_name_or_mapping() -> None:
    fleet = parse_fleet(
        {
            "models": [
                {"name": "a", "model": "llama-3.1-8b", "routing": "round_robin"},
                {"name": "b", "model": "llama-3.1-8b", "routing": {"policy": "kv_aware"}},
            ]
        }
    )
    assert isinstance(fleet.models[0].routing, RoundRobinConfig)
    assert isinstance(fleet.models[1].routing, KVAwareConfig)


def test_external_models_count_their_endpoints() -> None:
    fleet = parse_fleet(
        {
            "models": [
                {
                    "name": "remote",
                    "engine": "external",
                    "endpoints": ["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
                }
            ]
        }
    )
    assert fleet.models[0].replica_count == 2


def test_engine_fields_and_the_startup_budget() -> None:
    fleet = parse_fleet(
        {
            "models": [
                {"name": "llama-3.1-8b"},
                {
                    "name": "tiny",
                    "model": "/models/tiny",
                    "engine": "vllm",
                    "gpu_memory_utilization": 0.5,
                    "max_model_len": 1024,
                    "prefix_caching": False,
                    "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                },
                {"name": "big", "engine": "vllm", "startup": {"timeout": 3600}},
            ]
        }
    )
    sim, tiny, big = fleet.models
    assert (sim.gpu_memory_utilization, sim.max_model_len, sim.prefix_caching) == (None, None, True)
    assert sim.env == {}
    assert (tiny.gpu_memory_utilization, tiny.max_model_len) == (0.5, 1024)
    assert tiny.prefix_caching is False
    assert tiny.env == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    assert sim.startup_timeout == STARTUP_TIMEOUTS[EngineKind.SIM]
    assert tiny.startup_timeout == STARTUP_TIMEOUTS[EngineKind.VLLM] >= 15 * 60
    assert big.startup_timeout == 3600


def test_the_profile_is_the_engine_fields_then_args_on_the_fleets_seed() -> None:
    fleet = parse_fleet(
        {
            "models": [
                {
                    "name": "llama-3.1-8b",
                    "tp": 2,
                    "max_model_len": 4096,
                    "prefix_caching": False,
                    "args": ["--max-model-len", "2048", "--time-scale", "10"],
                },
                {"name": "seeded", "model": "llama-3.1-8b", "args": ["--seed=9"]},
            ]
        }
    )
    model, seeded = fleet.models
    assert model.profile(seed=3) == ReplicaProfile(
        tp=2,
        max_model_len=2048,  # args win
        enable_prefix_caching=False,
        seed=3,  # the fleet's
        extra=("--time-scale", "10"),
    )
    assert model.profile().seed is None
    assert seeded.profile(seed=3).seed == 9  # a seed in args wins too
    assert model.max_num_seqs == 256 == model.profile().running_batch_cap


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"models": [{"name": "llama-3.1-8b", "gpu": "h999"}]}, "models[0]: "),
        (
            {"models": [{"name": "llama-3.1-8b", "gpu_memory_utilization": 1.2}]},
            "models[0].gpu_memory_utilization: ",
        ),
        ({"models": [{"name": "llama-3.1-8b", "max_model_len": 0}]}, "models[0].max_model_len"),
        (
            {"models": [{"name": "llama-3.1-8b", "startup": {"timeout": 0}}]},
            "models[0].startup.timeout: ",
        ),
        (
            {
                "models": [
                    {
                        "name": "x",
                        "engine": "external",
                        "endpoints": ["http://a"],
                        "max_model_len": 10,
                    }
                ]
            },
            "max_model_len: an external model's engine is configured by whoever runs it",
        ),
        ({"models": [{"name": "nope-7b"}]}, "models[0]: "),
        (
            {"models": [{"name": "llama-3.1-8b", "routing": {"policy": "prefix_aware", "x": 1}}]},
            "models[0].routing.x: Extra inputs are not permitted",
        ),
        (
            {"models": [{"name": "llama-3.1-8b", "routing": {"balance_rel": 0.5}}]},
            "models[0].routing",
        ),
        (
            {"models": [{"name": "llama-3.1-8b", "routing": "random"}]},
            "models[0].routing",
        ),
        (
            {"models": [{"name": "llama-3.1-8b", "replicas": -1}]},
            "models[0].replicas: Input should be greater than or equal to 0",
        ),
        (
            {"models": [{"name": "llama-3.1-8b", "health": {"outlier": {"consecutive_5xx": 0}}}]},
            "models[0].health.outlier.consecutive_5xx: ",
        ),
        (
            {"models": [{"name": "llama-3.1-8b"}], "gateway": {"port": 70000}},
            "gateway.port: ",
        ),
        (
            {"models": [{"name": "llama-3.1-8b"}], "gateway": {"timeouts": {"connect": 0}}},
            "gateway.timeouts.connect: ",
        ),
        ({"models": []}, "models: "),
        ({"gateway": {}}, "models: Field required"),
        ({"models": [{"name": "Llama 8B", "model": "llama-3.1-8b"}]}, "lower-case"),
        ({"models": [{"name": "llama-3.1-8b"}, {"name": "llama-3.1-8b"}]}, "given twice"),
        ({"models": [{"name": "x", "engine": "external"}]}, "needs at least one"),
        ({"models": [{"name": "llama-3.1-8b", "endpoints": ["http://a"]}]}, "for external"),
        (
            {"models": [{"name": "llama-3.1-8b", "args": ["--block-size", "x"]}]},
            "models[0]: args: --block-size 'x' is not an integer",
        ),
        (
            {"models": [{"name": "llama-3.1-8b", "args": ["--max-model-len=0"]}]},
            "models[0]: args: max_model_len (--max-model-len) must be at least 1",
        ),
        (
            {"models": [{"name": "llama-3.1-8b", "args": ["--tensor-parallel-size", "2"]}]},
            "models[0]: args: --tensor-parallel-size: set `tp` instead",
        ),
        ("just text", "expected a mapping"),
    ],
)
def test_errors_name_the_field(data: object, message: str) -> None:
    with pytest.raises(FleetFileError) as caught:
        parse_fleet(data, source="fleet.yaml")
    text = str(caught.value)
    assert text.startswith("fleet.yaml: ")
    assert message in text
    assert "\n" not in text


def test_unknown_gpu_message_is_the_catalogs() -> None:
    with pytest.raises(FleetFileError, match=r"models\[0\]: .*h999"):
        parse_fleet({"models": [{"name": "llama-3.1-8b", "gpu": "h999"}]})


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FleetFileError, match=r"missing\.yaml: No such file"):
        load_fleet(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(FleetFileError, match="not valid YAML"):
        load_fleet(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(FleetFileError, match="got nothing"):
        load_fleet(empty)


def test_autoscale_pool_starts_at_min_and_checks_its_bounds() -> None:
    fleet = parse_fleet(
        {
            "models": [
                {
                    "name": "llama-3.1-8b",
                    "autoscale": {"min_replicas": 3, "max_replicas": 8, "prewarm": 1},
                    "startup": {"provision": 240, "load": 90},
                }
            ]
        }
    )
    (model,) = fleet.models
    assert model.autoscale is not None
    assert model.replica_count == 3
    assert model.startup.cold == 330.0
    with pytest.raises(FleetFileError, match="replicas: 20 is outside autoscale's"):
        parse_fleet(
            {"models": [{"name": "m", "model": "llama-3.1-8b", "replicas": 20, "autoscale": {}}]}
        )
    with pytest.raises(FleetFileError, match="external model cannot autoscale"):
        parse_fleet(
            {
                "models": [
                    {
                        "name": "m",
                        "engine": "external",
                        "endpoints": ["http://127.0.0.1:9"],
                        "autoscale": {},
                    }
                ]
            }
        )


def _external(endpoints: list[str], **more: object) -> dict[str, object]:
    return {"name": "remote", "engine": "external", "endpoints": endpoints, **more}


def _tls(cert: Path, key: Path, **more: object) -> dict[str, object]:
    return {"gateway": {"tls": {"cert_file": str(cert), "key_file": str(key), **more}}}


def test_tls_on_the_gateway_and_a_ca_bundle_for_https_endpoints(tmp_path: Path) -> None:
    for name in ("tls.pem", "tls.key", "ca.pem"):
        (tmp_path / name).write_text("PEM, checked when the gateway loads it\n")
    fleet = parse_fleet(
        {
            **_tls(tmp_path / "tls.pem", tmp_path / "tls.key"),
            "models": [
                _external(
                    ["https://gpu-a.internal:8443", "http://10.0.0.2:8000"],
                    ca_file=str(tmp_path / "ca.pem"),
                )
            ],
        }
    )
    tls = fleet.gateway.tls
    assert tls is not None
    assert (tls.cert_file, tls.key_file) == (str(tmp_path / "tls.pem"), str(tmp_path / "tls.key"))
    assert tls.reload_interval == 5.0
    assert fleet.models[0].ca_file == str(tmp_path / "ca.pem")
    assert parse_fleet({"models": [{"name": "llama-3.1-8b"}]}).gateway.tls is None


def test_tls_errors_name_the_field_and_the_path(tmp_path: Path) -> None:
    cert = tmp_path / "tls.pem"
    cert.write_text("x")
    missing = tmp_path / "nowhere" / "tls.key"
    cases: list[tuple[dict[str, object], str]] = [
        (_tls(cert, missing), f"gateway.tls.key_file: {missing}: no such file"),
        (_tls(tmp_path, cert), f"gateway.tls.cert_file: {tmp_path}: a directory, not a file"),
        ({"gateway": {"tls": {"cert_file": str(cert)}}}, "gateway.tls.key_file: Field required"),
        (_tls(cert, cert, reload_interval=0), "gateway.tls.reload_interval: Input should be"),
        (
            {"models": [_external(["https://a:1"], ca_file=str(missing))]},
            f"models[0].ca_file: {missing}: no such file",
        ),
        (
            {"models": [_external(["http://a:1"], ca_file=str(cert))]},
            "models[0]: ca_file: no endpoint is an https:// URL",
        ),
        (
            {"models": [{"name": "llama-3.1-8b", "ca_file": str(cert)}]},
            "models[0]: ca_file is for an external model's https:// endpoints, not 'sim'",
        ),
    ]
    for data, message in cases:
        data.setdefault("models", [{"name": "llama-3.1-8b"}])
        with pytest.raises(FleetFileError) as caught:
            parse_fleet(data, source="fleet.yaml")
        assert str(caught.value).startswith(f"fleet.yaml: {message}")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.1.1", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.5", False),
        ("gateway.internal", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_auth_written_tells_a_default_from_a_choice() -> None:
    def tenants(data: dict[str, object]) -> TenantsConfig:
        return parse_fleet({"models": [{"name": "llama-3.1-8b"}], **data}).tenants

    assert not tenants({}).auth_written
    assert not tenants({"tenants": {"refresh_interval": 1}}).auth_written
    written = tenants({"tenants": {"auth": False}})
    assert written.auth_written
    assert written.auth is False
    assert tenants({"tenants": {"auth": True}}).auth_written
