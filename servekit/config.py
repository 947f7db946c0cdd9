"""One loader for every config dataclass: from a mapping or a YAML file, unknown keys an error, and
an error in a file naming its line."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, TypeVar

import yaml

C = TypeVar("C")


class ConfigError(ValueError):
    """A refused config value. `keys` is where it sits in the config, as far as known:
    (section, key), (section,) or () - what finds its line in a file; `more` are other places it
    may sit, likeliest first (a message that names several keys)."""

    def __init__(
        self, message: str, keys: tuple[str, ...] = (), more: tuple[tuple[str, ...], ...] = ()
    ):
        super().__init__(message)
        self.keys, self.more = keys, more


def config_from_dict(cls: type[C], data: dict[str, Any] | None, where: str = "") -> C:
    """A config dataclass from a mapping (a YAML section); unknown keys are an error, not a silent
    typo. `where` names the section in the message (default: the class name) and is the
    ConfigError's key path ("a.b" for a nested one)."""
    section = tuple(where.split(".")) if where else ()
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__}: expected a mapping, got {data!r}", section)
    data = dict(data or {})
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"{where or cls.__name__}: unknown key(s) {', '.join(unknown)} "
            f"(known: {', '.join(sorted(names))})",
            (*section, unknown[0]),
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key, value in data.items():
        problem = _type_problem(fields[key].type, value)
        if problem:
            raise ConfigError(f"{where or cls.__name__}.{key}: {problem}", (*section, key))
    try:
        return cls(**data)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        # The keys the message names, in its order: the first one the file holds is reported.
        found = [(m.start(), k) for k in data if (m := re.search(rf"\b{re.escape(k)}\b", str(exc)))]
        named = [(*section, k) for _, k in sorted(found)]
        raise ConfigError(str(exc), named[0] if named else section, tuple(named[1:])) from None


# Field annotations (strings: `from __future__ import annotations`) checked before the dataclass
# sees a value: a YAML typo (`num_blocks: 1O24`, `port:`) is named, not a TypeError deep inside.
# A str field takes numbers too: YAML reads `cpus: 0` or `--set prefill.cpus=0` as one.
_SCALARS = {"int": (int,), "float": (int, float), "str": (str, int, float), "bool": (bool,)}
_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}


def _type_problem(annotation: object, value: object) -> str:
    """'' when `value` fits a field annotated `annotation` (int, float, str, bool, list[...] of
    those; others are the dataclass's to check), else what was expected."""
    name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    if name in _SCALARS:
        fits = isinstance(value, _SCALARS[name]) and (name == "bool" or not isinstance(value, bool))
        return "" if fits else f"expected {_WORDS[name]}, got {value!r}"
    inner = name[5:-1] if name.startswith("list[") and name.endswith("]") else ""
    if inner in _SCALARS:
        if not isinstance(value, list):
            return f"expected a list, got {value!r}"
        for i, item in enumerate(value):
            problem = _type_problem(inner, item)
            if problem:
                return f"[{i}]: {problem}"
    return ""


def read_yaml(path: str | Path) -> tuple[Any, dict[tuple[str, ...], int]]:
    """A YAML file's data and the 1-based line of every mapping key, by key path. A file that is
    not YAML (or not UTF-8) is a ValueError naming the file and line."""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte {exc.start})") from None
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)  # the C parser when built
    try:
        node = loader.get_single_node()  # the tree with each key's position, then its data
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ValueError(f"{where}: not valid YAML: {problem}") from None
    finally:
        loader.dispose()
    lines: dict[tuple[str, ...], int] = {}

    def walk(n, keys: tuple[str, ...]) -> None:
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                if isinstance(k, yaml.ScalarNode):
                    lines.setdefault((*keys, str(k.value)), k.start_mark.line + 1)
                    walk(v, (*keys, str(k.value)))

    walk(node, ())
    return data, lines


def located(path: str | Path, lines: dict[tuple[str, ...], int], exc: ValueError) -> ValueError:
    """`exc` with the file and line of the value it refuses: its key path (or one of its other
    places), else the same key at the top level (cluster-wide values are copied into sections),
    else the nearest section."""
    keys = getattr(exc, "keys", ())
    candidates = []
    for k in (keys, *getattr(exc, "more", ())):
        candidates += [k, k[-1:]]
    candidates += [keys[:i] for i in range(len(keys) - 1, 0, -1)]
    line = next((lines[k] for k in candidates if k and k in lines), None)
    return ValueError(f"{path}:{line}: {exc}" if line else f"{path}: {exc}")


def config_from_yaml(cls: type[C], path: str | Path, section: str | None = None) -> C:
    """A config dataclass from a YAML file (or one top-level section of it); an error names the
    file and line."""
    data, lines = read_yaml(path)
    data = data or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}:1: expected a mapping at the top level")
    try:
        return config_from_dict(cls, data.get(section) if section else data, section or "")
    except ConfigError as exc:
        raise located(path, lines, exc) from None


def field_names(obj_or_cls) -> set[str]:
    """The field names of a config dataclass (or instance)."""
    return {f.name for f in dataclasses.fields(obj_or_cls)}


def parse_overrides(items: list[str]) -> dict:
    """`--set a.b=value` items as a nested mapping; values are read as YAML scalars (1, 0.5, true,
    text)."""
    out: dict = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        parts = key.strip().split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {key}: {p} is both a value and a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return out


def merge_config(base: dict, over: dict) -> dict:
    """`over` laid on `base`, sections merged key by key (a value replaces a value)."""
    out = dict(base)
    for k, v in over.items():
        both_sections = isinstance(v, dict) and isinstance(out.get(k), dict)
        out[k] = merge_config(out[k], v) if both_sections else v
    return out
