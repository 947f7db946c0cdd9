"""`halfmoon generate --local` through the real console script: the answer, and one clear error line
for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from model.fetch import smollm2_path

HALFMOON = str(Path(sys.executable).parent / "halfmoon")


def _run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HALFMOON_DEBUG"}
    env["OMP_NUM_THREADS"] = "1"  # see tests/test_model_smollm2.py: a shared 2-core machine
    return subprocess.run(
        [HALFMOON, "generate", "--local", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _assert_one_error_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    for w in words:
        assert w in lines[0], lines[0]


@pytest.mark.skipif(not smollm2_path().exists(), reason="SmolLM2 GGUF not fetched (make setup)")
def test_paris():
    proc = _run("The capital of France is", "--max-tokens", "8", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The capital of France is")
    assert "Paris" in proc.stdout[len("The capital of France is") :]


def test_tiny_json_and_chat():
    proc = _run("hello", "--model", "tiny-random", "--max-tokens", "5", "--json", "--chat")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["model"] == "tiny-random" and 1 <= record["completion_tokens"] <= 5
    assert record["prompt_tokens"] > len("hello")  # the chat template wrapped it


def test_unknown_model():
    _assert_one_error_line(
        _run("hi", "--model", "no-such-model"), "unknown model", "no-such-model", "tiny-random"
    )


def test_missing_gguf(tmp_path):
    missing = tmp_path / "absent.gguf"
    _assert_one_error_line(_run("hi", "--model", str(missing)), "not found", str(missing))


def test_corrupt_gguf(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a model" * 100)
    _assert_one_error_line(_run("hi", "--model", str(garbage)), "not a GGUF file", str(garbage))
    if smollm2_path().exists():  # a real header cut short
        truncated = tmp_path / "truncated.gguf"
        with open(smollm2_path(), "rb") as f:
            truncated.write_bytes(f.read(200_000))
        _assert_one_error_line(
            _run("hi", "--model", str(truncated)), "corrupt GGUF", str(truncated)
        )


def test_empty_prompt():
    _assert_one_error_line(_run("  ", "--model", "tiny-random"), "empty prompt")


def test_prompt_beyond_context_window():
    # tiny-random: one token per byte, a 2048-token window.
    _assert_one_error_line(
        _run("a" * 3000, "--model", "tiny-random"), "3000 tokens", "context window of 2048"
    )
