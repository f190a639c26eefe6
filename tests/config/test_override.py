"""``set_field``: one fleet-file field by its path, on a copy; ``parse_fleet`` judges the rest."""

from __future__ import annotations

import pytest

from gpufleet.config import field_path, parse_fleet, set_field

FLEET = {"models": [{"name": "llama-3.1-8b", "replicas": 2, "routing": "prefix_aware"}]}


def test_paths_read_as_the_fleet_file_errors_name_fields() -> None:
    assert field_path("models[0].routing.kv_weight") == ["models", 0, "routing", "kv_weight"]
    assert field_path("gateway.scrape_interval") == ["gateway", "scrape_interval"]
    for bad in ("models[x].tp", "models.", ".tp", "models[0]..tp", "a b"):
        with pytest.raises(ValueError, match="not a field path"):
            field_path(bad)


def test_set_field_copies_and_creates_mappings_on_the_way() -> None:
    data = set_field(FLEET, "models[0].replicas", 4)
    data = set_field(data, "models[0].startup.load", 30.0)
    data = set_field(data, "gateway.scrape_interval", 0.5)
    assert FLEET["models"][0]["replicas"] == 2  # untouched
    fleet = parse_fleet(data)
    assert fleet.models[0].replicas == 4
    assert fleet.models[0].startup.load == 30.0
    assert fleet.gateway.scrape_interval == 0.5


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("models[1].tp", "models has 1 entries, no [1]"),
        ("models[0].routing.kv_weight", "models[0].routing is 'prefix_aware', not a mapping"),
        ("models[0][0]", "models[0] is not a list"),
    ],
)
def test_set_field_says_where_a_path_goes_wrong(path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        set_field(FLEET, path, 1)


def test_an_unknown_field_is_the_fleet_files_error() -> None:
    with pytest.raises(ValueError, match=r"models\[0\]\.colour: Extra inputs"):
        parse_fleet(set_field(FLEET, "models[0].colour", "red"))
