"""A server process's log lines reach stderr at $HALFMOON_LOG_LEVEL (INFO by default): without a
handler Python drops INFO lines, so a deployed server said nothing of its role switches or
calibrations. Run in a fresh interpreter: pytest has its own handlers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = (
    "import logging; from servekit import configure_server_logging; "
    "configure_server_logging('decode'); "
    "logging.getLogger('decode_node').info('an info line'); "
    "logging.getLogger('decode_node').warning('a warning line')"
)


def _stderr(level: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "HALFMOON_LOG_LEVEL"}
    if level is not None:
        env["HALFMOON_LOG_LEVEL"] = level
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=60, check=True)  # fmt: skip
    return out.stderr


def test_info_lines_are_kept_by_default_with_time_level_and_logger():
    err = _stderr(None)
    assert "INFO decode_node" in err and "an info line" in err
    assert "WARNING decode_node" in err


@pytest.mark.parametrize("level", ["WARNING", "warning"])
def test_a_higher_level_drops_info(level):
    err = _stderr(level)
    assert "an info line" not in err and "a warning line" in err


def test_an_unknown_level_is_said_and_info_kept():
    err = _stderr("LOUD")
    assert "HALFMOON_LOG_LEVEL='LOUD' is no log level" in err
    assert "an info line" in err
