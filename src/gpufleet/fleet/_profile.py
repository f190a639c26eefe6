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

**Engine seed.** Every replica of a fleet runs with the fleet's seed (``gateway.seed``; in the
simulator, the run's seed), whatever its pool or index: a Kubernetes Deployment cannot give
its pods different flags, and the replica model draws a request's output from ``(seed,
request id)``, so the same request gives the same output on any replica
(docs/design/replica-profile.md).
"""

from __future__ import annotations

import dataclasses
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
_ALIASES: Final = MappingProxyType(
    {"-tp": "--tensor-parallel-size", "--tp": "--tensor-parallel-size"}
)
"""vLLM's short ``-tp``, and ``--tp``, the sim engine's spelling before it took vLLM's."""
_FLAG_OF: Final = MappingProxyType(
    {
        **{field: flag for flag, (field, _) in _VALUED.items()},
        "enable_prefix_caching": "--enable-prefix-caching",
        "seed": _SEED,
    }
)

ENGINE_FLAGS: Final = (*_VALUED, *_PREFIX_CACHING, _SEED)
"""Every flag a profile reads, as ``to_argv`` writes them (aliases: ``-tp``, ``--tp``)."""


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
    extra: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra", tuple(self.extra))
        counts = {
            "tp": self.tp,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "num_gpu_blocks_override": self.num_gpu_blocks_override,
            "block_size": self.block_size,
        }
        for name, value in counts.items():
            if value is not None and value < 1:
                raise ValueError(f"{name} ({_FLAG_OF[name]}) must be at least 1, got {value}")
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
        replica model's ``ReplicaConfig`` and of the sim engine's ``SimEngineConfig``."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del values["extra"]
        return {name: value for name, value in values.items() if value is not None}

    def to_argv(self) -> tuple[str, ...]:
        """The engine flags, in a fixed order, ``extra`` last."""
        argv: list[str] = []
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
        (vLLM accepts both), the last one wins. Unknown tokens are appended to ``extra``;
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
            if flag in _PREFIX_CACHING:
                if eq:
                    raise ValueError(f"{flag} takes no value (the switch is its own flag)")
                fields["enable_prefix_caching"] = _PREFIX_CACHING[flag]
                continue
            if flag not in _VALUED and flag != _SEED:
                if not passthrough:
                    raise ValueError(f"no such option: {token}")
                extra.append(token)
                continue
            if not eq:
                if i == len(tokens):
                    raise ValueError(f"{flag} needs a value")
                value = tokens[i]
                i += 1
            field, kind = _VALUED.get(flag, ("seed", int))
            try:
                fields[field] = kind(value)
            except ValueError:
                what = "an integer" if kind is int else "a number"
                raise ValueError(f"{flag} {value!r} is not {what}") from None
        return dataclasses.replace(base or cls(), **fields, extra=tuple(extra))


_KNOWN: Final = frozenset((*ENGINE_FLAGS, *_ALIASES))


def _canonical(name: str) -> str:
    """A flag as the table spells it: aliases resolved, ``--max_num_seqs`` → ``--max-num-seqs``."""
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")
    return _ALIASES.get(name, name)
