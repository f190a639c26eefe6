"""The engine flags one replica runs with: one value, one command line, read back the same.

A fleet-file entry becomes a ``ReplicaProfile`` once (``ModelConfig.profile(seed)``); every
place that starts or models a replica reads that value, never the fleet file's ``args``::

    profile = ReplicaProfile(tp=2, max_num_seqs=64, seed=0, extra=("--time-scale", "10"))
    profile.to_argv()
    # ('--tensor-parallel-size', '2', '--max-num-seqs', '64', '--seed', '0',
    #  '--time-scale', '10')
    ReplicaProfile.from_argv(profile.to_argv()) == profile          # always
    ReplicaProfile.from_argv(["--max-num-seqs=8"], base=profile)    # a flag read later wins

The flags are vLLM's (the sim engine shares them); the field names are vLLM's Python names,
which the replica model (``ReplicaConfig``) and the sim engine (``SimEngineConfig``) use too,
so ``settings()`` feeds either. ``None`` is "not on the command line": the engine's default.
Flags this profile does not know are kept in ``extra``, in order, and come last (vLLM takes
any of its flags there; the sim engine its ``--time-scale`` and ``--fault-*``).

**LoRA adapters** are vLLM's flags too: ``--enable-lora`` (``--no-enable-lora``),
``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras`` and ``--lora-modules`` (the adapters
registered at start, ``name=path`` or vLLM's JSON object, one value each; a ``LoraModule``).
``--lora-modules`` takes every value up to the next flag, so ``to_argv`` writes it first: the
flag after it (``--tensor-parallel-size`` is always written) ends its list, and an ``extra``
token can never be read as an adapter.

**Engine seed.** Every replica of a fleet runs with the fleet's seed (``gateway.seed``; in the
simulator, the run's seed), whatever its pool or index: a Kubernetes Deployment cannot give
its pods different flags, and the replica model draws a request's output from ``(seed,
request id)``, so the same request gives the same output on any replica
(docs/design/replica-profile.md).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

DEFAULT_MAX_NUM_SEQS: Final = 256
"""vLLM's (and the sim engine's) ``--max-num-seqs`` when none is given."""

_VALUED: Final[Mapping[str, tuple[str, type[int] | type[float]]]] = MappingProxyType(
    {  # flag → (field, type), in the order to_argv writes them
        "--tensor-parallel-size": ("tp", int),
        "--max-num-seqs": ("max_num_seqs", int),
        "--max-num-batched-tokens": ("max_num_batched_tokens", int),
        "--max-model-len": ("max_model_len", int),
        "--gpu-memory-utilization": ("gpu_memory_utilization", float),
        "--num-gpu-blocks-override": ("num_gpu_blocks_override", int),
        "--block-size": ("block_size", int),
    }
)
_PREFIX_CACHING: Final = MappingProxyType(
    {"--enable-prefix-caching": True, "--no-enable-prefix-caching": False}
)
_SEED: Final = "--seed"
_LORA_SWITCH: Final = MappingProxyType({"--enable-lora": True, "--no-enable-lora": False})
_LORA_VALUED: Final[Mapping[str, tuple[str, type[int]]]] = MappingProxyType(
    {  # written after --seed, in this order
        "--max-loras": ("max_loras", int),
        "--max-lora-rank": ("max_lora_rank", int),
        "--max-cpu-loras": ("max_cpu_loras", int),
    }
)
_LORA_MODULES: Final = "--lora-modules"
_POLICY: Final = "--scheduling-policy"
SCHEDULING_POLICIES: Final = ("fcfs", "priority")
"""vLLM's ``--scheduling-policy`` values the profile takes (``fcfs`` is vLLM's default)."""
_VALUES: Final[Mapping[str, tuple[str, type[int] | type[float] | type[str]]]] = MappingProxyType(
    {**_VALUED, _SEED: ("seed", int), **_LORA_VALUED, _POLICY: ("scheduling_policy", str)}
)
"""Every flag that takes one value: flag → (field, type)."""
_ALIASES: Final = MappingProxyType(
    {"-tp": "--tensor-parallel-size", "--tp": "--tensor-parallel-size"}
)
"""vLLM's short ``-tp``, and ``--tp``, the sim engine's spelling before it took vLLM's."""
_FLAG_OF: Final = MappingProxyType(
    {
        **{field: flag for flag, (field, _) in _VALUED.items()},
        "enable_prefix_caching": "--enable-prefix-caching",
        "seed": _SEED,
        "enable_lora": "--enable-lora",
        **{field: flag for flag, (field, _) in _LORA_VALUED.items()},
        "lora_modules": _LORA_MODULES,
        "scheduling_policy": _POLICY,
    }
)

ENGINE_FLAGS: Final = (
    _LORA_MODULES,
    *_VALUED,
    *_PREFIX_CACHING,
    _SEED,
    *_LORA_SWITCH,
    *_LORA_VALUED,
    _POLICY,
)
"""Every flag a profile reads, as ``to_argv`` writes them (aliases: ``-tp``, ``--tp``)."""
LORA_SETTINGS: Final = frozenset(
    {"enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_modules"}
)
"""The ``settings()`` keys of the LoRA flags: the sim engine's (``SimEngineConfig``), not the
replica model's (``ReplicaConfig`` models no adapter; a caller that builds one drops them)."""


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One ``--lora-modules`` value: an adapter the engine registers at start (vLLM's
    ``LoRAModulePath``). ``base_model_name`` names the model it adapts (vLLM lists it as the
    adapter's ``parent`` when it is one of the served names; default: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.path:
            raise ValueError(f"{_LORA_MODULES}: an adapter needs a name and a path, got {self}")

    @classmethod
    def parse(cls, text: str) -> LoraModule:
        """vLLM's two spellings: ``name=path`` (no ``,``), else a JSON object with ``name``,
        ``path`` and optionally ``base_model_name``."""
        if "=" in text and "," not in text:
            name, _, path = text.partition("=")
            if "=" in path:
                raise ValueError(f"{_LORA_MODULES} {text!r}: name=path has one '='")
            return cls(name, path)
        try:
            data = json.loads(text)
        except ValueError:
            raise ValueError(f"{_LORA_MODULES} {text!r}: neither name=path nor JSON") from None
        fields = {"name", "path", "base_model_name"}
        if not isinstance(data, dict) or not {"name", "path"} <= data.keys() <= fields:
            raise ValueError(
                f"{_LORA_MODULES} {text!r}: a JSON adapter has name, path and optionally "
                "base_model_name"
            )
        name, path, base = data["name"], data["path"], data.get("base_model_name")
        if not (isinstance(name, str) and isinstance(path, str) and isinstance(base, str | None)):
            raise ValueError(f"{_LORA_MODULES} {text!r}: its fields are strings")
        return cls(name, path, base)

    def to_arg(self) -> str:
        """The value ``parse`` reads back as this module: ``name=path`` when that spelling
        can say it (and does not start with ``-``, which a parser reads as a flag), else
        compact JSON."""
        both = self.name + self.path
        plain = self.base_model_name is None and not self.name.startswith("-")
        if plain and "=" not in both and "," not in both:
            return f"{self.name}={self.path}"
        data = {"name": self.name, "path": self.path}
        if self.base_model_name is not None:
            data["base_model_name"] = self.base_model_name
        return json.dumps(data, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class ReplicaProfile:
    """One replica's engine settings: what its command line says, no more.

    ``tp`` is always written (it is the GPUs a replica takes); every other field is written
    only when set. ``extra`` holds the flags the profile does not know, passed through last.
    """

    tp: int = 1
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    num_gpu_blocks_override: int | None = None
    block_size: int | None = None
    enable_prefix_caching: bool | None = None
    seed: int | None = None
    enable_lora: bool | None = None
    """``--enable-lora``: serve LoRA adapters (vLLM's default: off)."""
    max_loras: int | None = None
    """``--max-loras``: adapters one batch may use (vLLM's default: 1)."""
    max_lora_rank: int | None = None
    """``--max-lora-rank``: the highest adapter rank the engine takes (vLLM's default: 16)."""
    max_cpu_loras: int | None = None
    """``--max-cpu-loras``: adapters kept loaded (vLLM's default: ``max_loras``)."""
    lora_modules: tuple[LoraModule, ...] | None = None
    """``--lora-modules``: adapters registered at start, in order (an empty tuple is ``None``)."""
    scheduling_policy: str | None = None
    """``--scheduling-policy``: ``fcfs`` (vLLM's default) or ``priority``: a request's
    ``priority`` (lower first) orders the waiting queue and picks whom a full KV cache
    preempts; the gateway sends batch lines with a lower one (docs/batch.md)."""
    extra: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra", tuple(self.extra))
        if self.lora_modules is not None:
            modules = tuple(self.lora_modules)
            object.__setattr__(self, "lora_modules", modules or None)
        counts = {
            "tp": self.tp,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "num_gpu_blocks_override": self.num_gpu_blocks_override,
            "block_size": self.block_size,
            "max_loras": self.max_loras,
            "max_lora_rank": self.max_lora_rank,
            "max_cpu_loras": self.max_cpu_loras,
        }
        for name, value in counts.items():
            if value is not None and value < 1:
                raise ValueError(f"{name} ({_FLAG_OF[name]}) must be at least 1, got {value}")
        policy = self.scheduling_policy
        if policy is not None and policy not in SCHEDULING_POLICIES:
            allowed = " or ".join(SCHEDULING_POLICIES)
            raise ValueError(f"{_POLICY} must be {allowed}, got {policy!r}")
        share = self.gpu_memory_utilization
        if share is not None and not 0.0 < share <= 1.0:
            flag = _FLAG_OF["gpu_memory_utilization"]
            raise ValueError(f"gpu_memory_utilization ({flag}) must be in (0, 1], got {share}")
        for token in self.extra:
            if _canonical(token.partition("=")[0]) in _KNOWN:
                raise ValueError(f"extra: {token} is a profile flag, not an extra one")

    @property
    def running_batch_cap(self) -> int:
        """``max_num_seqs``, or :data:`DEFAULT_MAX_NUM_SEQS` when unset: the cap the engine
        runs with, which the admission gate and the autoscaler judge saturation by."""
        return DEFAULT_MAX_NUM_SEQS if self.max_num_seqs is None else self.max_num_seqs

    def settings(self) -> dict[str, Any]:
        """The fields that are set, by name, without ``extra``: keyword arguments of the
        sim engine's ``SimEngineConfig``, and (less :data:`LORA_SETTINGS`) of the replica
        model's ``ReplicaConfig``. ``lora_modules`` is a tuple of ``LoraModule``."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del values["extra"]
        return {name: value for name, value in values.items() if value is not None}

    def to_argv(self) -> tuple[str, ...]:
        """The engine flags, in a fixed order (``--lora-modules`` first: see the module
        docstring), ``extra`` last."""
        argv: list[str] = []
        if self.lora_modules is not None:
            argv += [_LORA_MODULES, *(module.to_arg() for module in self.lora_modules)]
        for flag, (name, _) in _VALUED.items():
            value = getattr(self, name)
            if value is not None:
                argv += [flag, str(value)]  # str(float) is its shortest exact form
        if self.enable_prefix_caching is not None:
            argv.append(
                "--enable-prefix-caching"
                if self.enable_prefix_caching
                else "--no-enable-prefix-caching"
            )
        if self.seed is not None:
            argv += [_SEED, str(self.seed)]
        if self.enable_lora is not None:
            argv.append("--enable-lora" if self.enable_lora else "--no-enable-lora")
        for flag, (name, _) in _LORA_VALUED.items():
            value = getattr(self, name)
            if value is not None:
                argv += [flag, str(value)]
        if self.scheduling_policy is not None:
            argv += [_POLICY, self.scheduling_policy]
        return (*argv, *self.extra)

    @classmethod
    def from_argv(
        cls,
        argv: Iterable[str],
        base: ReplicaProfile | None = None,
        *,
        passthrough: bool = True,
    ) -> ReplicaProfile:
        """Read engine flags over ``base`` (default: an empty profile), as an engine reads
        its command line: ``--flag value`` or ``--flag=value``, ``_`` or ``-`` in the name
        (vLLM accepts both), the last one wins; ``--lora-modules`` takes the values up to the
        next token that starts with ``-`` (or the one value after ``=``). Unknown tokens are
        appended to ``extra``;
        with ``passthrough=False`` they are a ``ValueError`` (an engine that takes nothing
        else). A bad value is a ``ValueError`` that names its flag."""
        fields: dict[str, Any] = {}
        extra = list(base.extra) if base is not None else []
        tokens = list(argv)
        i = 0
        while i < len(tokens):
            token = tokens[i]
            i += 1
            name, eq, value = token.partition("=")
            flag = _canonical(name)
            if flag in _PREFIX_CACHING or flag in _LORA_SWITCH:
                if eq:
                    raise ValueError(f"{flag} takes no value (the switch is its own flag)")
                if flag in _LORA_SWITCH:
                    fields["enable_lora"] = _LORA_SWITCH[flag]
                else:
                    fields["enable_prefix_caching"] = _PREFIX_CACHING[flag]
                continue
            if flag == _LORA_MODULES:
                fields["lora_modules"], i = _lora_modules(tokens, i, value if eq else None)
                continue
            if flag not in _VALUES:
                if not passthrough:
                    raise ValueError(f"no such option: {token}")
                extra.append(token)
                continue
            if not eq:
                if i == len(tokens):
                    raise ValueError(f"{flag} needs a value")
                value = tokens[i]
                i += 1
            field, kind = _VALUES[flag]
            try:
                fields[field] = kind(value)
            except ValueError:
                what = "an integer" if kind is int else "a number"
                raise ValueError(f"{flag} {value!r} is not {what}") from None
        return dataclasses.replace(base or cls(), **fields, extra=tuple(extra))


_KNOWN: Final = frozenset((*ENGINE_FLAGS, *_ALIASES))


def _lora_modules(
    tokens: list[str], i: int, value: str | None
) -> tuple[tuple[LoraModule, ...], int]:
    """``--lora-modules``' values from ``tokens[i]`` on (or the one ``value`` given after
    ``=``), as argparse's ``nargs="+"`` takes them, and where the reading goes on."""
    values = [value] if value is not None else []
    while value is None and i < len(tokens) and not tokens[i].startswith("-"):
        values.append(tokens[i])
        i += 1
    modules = tuple(LoraModule.parse(v) for v in values if v)  # vLLM skips an empty value
    if not modules:
        raise ValueError(f"{_LORA_MODULES} needs a value")
    return modules, i


def _canonical(name: str) -> str:
    """A flag as the table spells it: aliases resolved, ``--max_num_seqs`` → ``--max-num-seqs``."""
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")
    return _ALIASES.get(name, name)
