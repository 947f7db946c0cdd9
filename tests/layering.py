"""The import rules of ../DESIGN.md's layering, read from the source (ast, every import statement,
those inside functions too): which area of the tree may import which. Used by test_layering.py,
which also plants violations to show the checker catches them."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

SERVERS = ("conductor", "prefill_node", "decode_node")
# kvstore is three areas: its shared, torch-free contracts (kvstore/*.py), the client side a
# worker links (kvstore.client) and the store node (kvstore.node)
AREAS = (
    "kernels",
    "model",
    "kvstore.client",
    "kvstore.node",
    "kvstore",
    "servekit",
    *SERVERS,
    "deploy",
    "client",
    "openai_api",
    "sim",
    "vllm_connector",
)
_ABOVE_MODEL = ("kvstore", "servekit", *SERVERS, "deploy", "client", "openai_api", "sim")

# area -> the areas (or module prefixes) it must not import, and why
FORBIDDEN: dict[str, tuple[tuple[str, ...], str]] = {
    "kernels": (("model", *_ABOVE_MODEL), "kernels sit below the model and know no server"),
    "model": (_ABOVE_MODEL, "the model knows nothing of stores, servers or networks"),
    "kvstore": (
        ("kvstore.client", "kvstore.node", "model", *SERVERS, "deploy", "client", "sim"),
        "the store's shared side is torch-free and imports neither of its own sides",
    ),
    "kvstore.client": (
        ("kvstore.node", "model", *SERVERS, "deploy", "client", "sim"),
        "workers reach the store node over its RPCs; the client knows no model beyond a layout",
    ),
    "kvstore.node": (
        ("kvstore.client", "model", "kernels", *SERVERS, "deploy", "client", "sim"),
        "a store node stores bytes: no tensors, no model, no other server",
    ),
    "servekit": (
        ("kvstore.client", "kvstore.node", *SERVERS, "deploy", "client", "sim"),
        "the neutral ground imports no server package (the role registry names them as text)",
    ),
    "conductor": (
        ("prefill_node", "decode_node", "kvstore.client", "kvstore.node", "deploy", "sim"),
        "the conductor never touches tensors and meets the workers over gRPC",
    ),
    "prefill_node": (
        ("decode_node", "conductor", "kvstore.node", "deploy", "sim"),
        "a worker uses the store's client side only and no other server",
    ),
    "decode_node": (
        ("prefill_node", "conductor", "kvstore.node", "deploy", "sim"),
        "a worker uses the store's client side only and no other server",
    ),
    "sim": (
        ("prefill_node", "decode_node", "kvstore", "deploy", "conductor.server"),
        "the simulator runs the conductor's pure policy and nothing of the servers' I/O",
    ),
    "client": (
        ("kvstore", "prefill_node", "decode_node", "conductor.server"),
        "the client library and CLI speak gRPC; `halfmoon serve` reaches servers through deploy",
    ),
    "openai_api": (
        ("kvstore.node", "prefill_node", "decode_node", "deploy"),
        "the HTTP front door speaks to the conductor only",
    ),
    "vllm_connector": (
        ("kvstore.node", *SERVERS, "deploy", "client", "openai_api", "sim", "kernels"),
        "vLLM's engine reaches the store as a worker does, through its client side",
    ),
}


class Violation(NamedTuple):
    path: str  # the importing file, relative to the root
    line: int  # the import statement's line
    imported: str  # the module it imports
    rule: str  # why that is not allowed


def area_of(module: str) -> str:
    """The area a dotted module name belongs to ('' = outside every area)."""
    for area in AREAS:  # the longer kvstore areas are listed before kvstore
        if module == area or module.startswith(area + "."):
            return area
    return ""


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in `source`, relative ones resolved; a
    `from pkg import name` counts as importing pkg.name as well (it may be a submodule)."""
    out = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names if a.name != "*"]
    return out


def check_file(path: Path, root: Path) -> list[Violation]:
    rel = path.relative_to(root)
    parts = list(rel.with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    module = ".".join(parts[:-1] if is_package else parts)
    area = area_of(module)
    if area not in FORBIDDEN:
        return []
    banned, why = FORBIDDEN[area]
    found: list[Violation] = []
    for line, imported in imports_of(path.read_text(encoding="utf-8"), module, is_package):
        if any(v.line == line for v in found):
            continue  # one report per statement (`from pkg import name` also yields pkg.name)
        if area_of(imported) == area:
            continue  # within its own area
        for b in banned:
            if _within(imported, b):
                found.append(Violation(str(rel), line, imported, f"{area}: {why}"))
                break
    return found


def check_tree(root: Path) -> list[Violation]:
    out = []
    for area in {a.split(".")[0] for a in FORBIDDEN}:
        for path in sorted((root / area).rglob("*.py")):
            out += check_file(path, root)
    return out
