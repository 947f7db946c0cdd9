"""One loader for every config dataclass: from a mapping or a YAML file, unknown keys an error."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, TypeVar

import yaml

C = TypeVar("C")


def config_from_dict(cls: type[C], data: dict[str, Any] | None, where: str = "") -> C:
    """A config dataclass from a mapping (a YAML section); unknown keys are an error, not a silent
    typo. `where` names the section in the message (default: the class name)."""
    if data is not None and not isinstance(data, dict):
        raise ValueError(f"{where or cls.__name__}: expected a mapping, got {data!r}")
    data = dict(data or {})
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(
            f"{where or cls.__name__}: unknown key(s) {', '.join(unknown)} "
            f"(known: {', '.join(sorted(names))})"
        )
    return cls(**data)


def config_from_yaml(cls: type[C], path: str | Path, section: str | None = None) -> C:
    """A config dataclass from a YAML file (or one top-level section of it)."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    return config_from_dict(cls, data.get(section) if section else data, section or "")


def field_names(obj_or_cls) -> set[str]:
    """The field names of a config dataclass (or instance)."""
    return {f.name for f in dataclasses.fields(obj_or_cls)}
