"""Names a package exports that load on first use, written as plain imports.

A package whose modules import torch but whose torch-free part other processes need (the
conductor computes block keys and tokenizes; torch alone costs a process ~170 MB) declares those
names under `if TYPE_CHECKING:` in its `__init__.py`, where a reader and mypy see them as
ordinary imports, and sets `__getattr__ = deferred(__name__, __file__, globals())`: at run time
each such name is imported the first time it is used. The imports under TYPE_CHECKING are the
one list; nothing repeats them as strings.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


def deferred_imports(init_file: str) -> dict[str, str]:
    """name -> module of each `from MODULE import name` in the file's `if TYPE_CHECKING:`
    block(s)."""
    tree = ast.parse(Path(init_file).read_text(encoding="utf-8"))
    found: dict[str, str] = {}
    for node in tree.body:
        if not (isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0:
                for alias in stmt.names:
                    found[alias.asname or alias.name] = stmt.module
    return found


def deferred(package: str, init_file: str, namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The package's module `__getattr__`: a deferred name imported on first use (then kept in
    the package's namespace, so it is looked up once)."""
    names = deferred_imports(init_file)

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
