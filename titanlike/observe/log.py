"""Rank-aware logging: rank 0 logs at INFO, other ranks only warnings and errors (each line says its rank).

TITANLIKE_LOG_LEVEL=DEBUG (any logging level name) sets rank 0's level, e.g. to see the tensor-parallel plan."""
from __future__ import annotations

import logging
import os
import sys


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever sys.stdout is when a record is emitted, not the stream of the moment of set-up: a tool
    called in-process (tests, notebooks) may see sys.stdout swapped and the old one closed after set-up."""

    def __init__(self):
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ / setStream assign it; sys.stdout is always used
        pass


def setup_logging(rank: int | None = None) -> logging.Logger:
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    logger = logging.getLogger("titanlike")
    logger.handlers.clear()
    handler = _StdoutHandler()
    prefix = f"[rank{rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    level = logging.getLevelName(os.environ.get("TITANLIKE_LOG_LEVEL", "INFO").upper())
    logger.setLevel((level if isinstance(level, int) else logging.INFO) if rank == 0 else logging.WARNING)
    logger.propagate = False
    return logger
