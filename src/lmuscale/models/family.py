"""The registry of model families, one record each: every entry point asks it, so a new family
is one file that calls ``register`` plus its import in ``models/__init__.py``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Family:
    """What the framework knows about one family of language models.

    Attributes:
      name: the config's ``model.family`` and the prefix of its named models ("lmu-1M").
      config: a frozen dataclass; its fields, less ``fixed``, are the model section's keys.
      model: the ``LanguageModel`` class; sized: ``(size, **overrides) -> config``.
      params, flops: ``config -> sizes.ParamCount``, ``(config, seq_len) -> sizes.FlopCount``.
      shape: ``config -> dict``, the shape columns of ``python -m lmuscale.models`` (default none).
      fixed: config fields the family's name decides (LMU_G: ``global_attention=True``),
        left out of the model section and restored from the name.
      legacy: fields added after runs were saved, with the values those runs used; a saved
        config that lacks one resumes with it (``lmuscale.resume.upgrade``).
    """

    name: str
    config: type
    model: type
    sized: Callable[..., Any]
    params: Callable[[Any], Any]
    flops: Callable[[Any, int], Any]
    shape: Callable[[Any], dict] = lambda config: {}
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    legacy: Mapping[str, Any] = dataclasses.field(default_factory=dict)


REGISTRY: dict[str, Family] = {}


def register(record: Family) -> Family:
    if REGISTRY.get(record.name, record) != record:
        raise ValueError(f"model family {record.name!r} is already registered")
    REGISTRY[record.name] = record
    return record


def names() -> tuple[str, ...]:
    """The registered families, in the order they were registered."""
    return tuple(REGISTRY)


def get(name: str) -> Family:
    try:
        return REGISTRY[name]
    except KeyError:
        known = names()
        raise ValueError(
            f"model.family must be {', '.join(known[:-1])} or {known[-1]}, got {name!r}"
        ) from None


def of(config) -> Family:
    """The family a config belongs to: its class, and the values of that family's fixed fields."""
    for record in REGISTRY.values():
        if type(config) is record.config and all(
            getattr(config, key) == value for key, value in record.fixed.items()
        ):
            return record
    raise TypeError(f"no registered model family for a {type(config).__name__}")


class Registered:
    """Base of the config classes: ``config.family`` is the name of its registered family."""

    @property
    def family(self) -> str:
        return of(self).name


ModelConfig = Registered  # the type of every family's config
