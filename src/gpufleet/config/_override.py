"""One field of a fleet file set by its path, as the fleet file's errors name fields::

    set_field(data, "models[0].replicas", 4)
    set_field(data, "models[0].routing.kv_weight", 2.0)
    set_field(data, "gateway.scrape_interval", 0.5)

``data`` is the file's content as YAML loads it; a new mapping comes back (``data`` is left
as it was). Mappings on the way are created when missing; a list index must exist. The
result is not validated here: ``parse_fleet`` does that, and names an unknown field.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any, Final

_SEGMENT: Final = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)")
_INDEX: Final = re.compile(r"\[(\d+)\]")


def field_path(path: str) -> list[str | int]:
    """``models[0].routing.policy`` → ``["models", 0, "routing", "policy"]``."""
    parts: list[str | int] = []
    for segment in path.split("."):
        match = _SEGMENT.fullmatch(segment)
        if match is None:
            raise ValueError(
                f"{path!r} is not a field path (write it as models[0].replicas, "
                "gateway.scrape_interval, …)"
            )
        parts.append(match.group(1))
        parts.extend(int(i) for i in _INDEX.findall(match.group(2)))
    return parts


def _shown(parts: list[str | int]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def set_field(data: Mapping[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of ``data`` with the field at ``path`` set to ``value``."""
    parts = field_path(path)
    out = copy.deepcopy(dict(data))
    here: Any = out
    for k, part in enumerate(parts):
        last = k == len(parts) - 1
        where = _shown(parts[:k])
        if isinstance(part, int):
            if not isinstance(here, list):
                raise ValueError(f"{path}: {where} is not a list")
            if part >= len(here):
                raise ValueError(f"{path}: {where} has {len(here)} entries, no [{part}]")
            if last:
                here[part] = value
            else:
                here = here[part]
            continue
        if not isinstance(here, dict):
            shown = f"{where} is {here!r}" if where else "the file"
            raise ValueError(f"{path}: {shown}, not a mapping with fields")
        if last:
            here[part] = value
        else:
            nxt = parts[k + 1]
            if part not in here or here[part] is None:
                here[part] = {} if isinstance(nxt, str) else []
            here = here[part]
    return out
