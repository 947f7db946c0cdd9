"""The tree's size rule: no Python file outside protos/ and tests/ over 500 lines, no class over
300. A file that grows past it is split by concern, not squeezed."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_LINES, MAX_CLASS_LINES = 500, 300
SKIP = {"protos", "tests", ".venv", ".venv-vllm", "runs", "build"}


def _sources() -> list[Path]:
    return [
        p
        for p in sorted(ROOT.rglob("*.py"))
        if not SKIP & set(p.relative_to(ROOT).parts) and not p.name.endswith(("_pb2.py",))
    ]


def oversized(paths: list[Path], root: Path = ROOT) -> list[str]:
    """'path: N lines' and 'path:Class: N lines' for each file or class past the rule."""
    out = []
    for p in paths:
        text = p.read_text(encoding="utf-8")
        n = text.count("\n") + (not text.endswith("\n") and bool(text))
        if n > MAX_FILE_LINES:
            out.append(f"{p.relative_to(root)}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    out.append(f"{p.relative_to(root)}:{node.name}: {size} lines")
    return out


def test_no_file_or_class_past_the_size_rule():
    assert oversized(_sources()) == []


def test_the_rule_catches_a_long_file_and_a_long_class(tmp_path):
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    body = "".join(f"    a{i} = {i}\n" for i in range(MAX_CLASS_LINES))
    (tmp_path / "big.py").write_text("class Big:\n" + body)
    assert oversized(sorted(tmp_path.glob("*.py")), tmp_path) == [
        f"big.py:Big: {MAX_CLASS_LINES + 1} lines",
        f"long.py: {MAX_FILE_LINES + 1} lines",
    ]
