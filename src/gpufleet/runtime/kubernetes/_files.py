"""Manifests as files: one YAML document per object, named so that ``ls`` is apply order.

``manifest_files(objects)`` is pure: it returns ``(file name, text)`` pairs; the command
writes them. ``03-configmap-gpufleet-gateway.yaml``: the object's place in the list, its kind
and its name, so that ``kubectl apply -f DIR`` (which reads a directory in name order) creates
the namespace and the ServiceAccount before what uses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from gpufleet.runtime.kubernetes._render import Manifest


class _Dumper(yaml.SafeDumper):
    """Block style, keys in the order they were built, multi-line strings as ``|`` blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(obj: Manifest) -> str:
    """One object as a YAML document (deterministic: same object, same bytes)."""
    text: Any = yaml.dump(
        obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True
    )
    return str(text)


def manifest_files(objects: Sequence[Manifest]) -> list[tuple[str, str]]:
    """``(file name, YAML text)`` per object, in the objects' order."""
    width = max(2, len(str(len(objects) - 1)))
    return [
        (f"{i:0{width}d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml", to_yaml(obj))
        for i, obj in enumerate(objects)
    ]
