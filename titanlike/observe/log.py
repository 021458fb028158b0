"""Rank-aware logging: rank 0 logs at INFO, other ranks only warnings and errors (each line says its rank).

TITANLIKE_LOG_LEVEL=DEBUG (any logging level name) sets rank 0's level, e.g. to see the tensor-parallel plan."""
from __future__ import annotations

import logging
import os
import sys


def setup_logging(rank: int | None = None) -> logging.Logger:
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    logger = logging.getLogger("titanlike")
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    prefix = f"[rank{rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    level = logging.getLevelName(os.environ.get("TITANLIKE_LOG_LEVEL", "INFO").upper())
    logger.setLevel((level if isinstance(level, int) else logging.INFO) if rank == 0 else logging.WARNING)
    logger.propagate = False
    return logger
