"""Where a server process's log lines go. Without a handler Python drops INFO lines and prints
warnings bare, so a deployed server said nothing of its role switches, calibrations or
refusals; a server process (a Ray actor, a LocalCluster child) calls `configure_server_logging`
once, before it builds its server. In-process servers (tests, notebooks) log as their host
configures."""

from __future__ import annotations

import logging
import os

LOG_LEVEL_ENV = "HALFMOON_LOG_LEVEL"  # DEBUG | INFO | WARNING | ERROR; default INFO
_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d]: %(message)s"


def configure_server_logging(role: str) -> None:
    """Log records of `role`'s process to stderr at $HALFMOON_LOG_LEVEL (INFO by default); an
    unknown level is said and INFO kept. A root logger that has handlers already is left."""
    root = logging.getLogger()
    if root.handlers:
        return
    name = os.environ.get(LOG_LEVEL_ENV, "INFO").upper()
    level = logging.getLevelName(name)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT))
    root.addHandler(handler)
    root.setLevel(level if isinstance(level, int) else logging.INFO)
    if not isinstance(level, int):
        logging.getLogger(__name__).warning(
            "%s=%r is no log level (DEBUG, INFO, WARNING, ERROR): INFO", LOG_LEVEL_ENV, name
        )
    logging.getLogger(__name__).debug("%s process logging at %s", role, name)
