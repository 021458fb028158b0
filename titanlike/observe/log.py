"""Rank-aware logging: rank 0 logs at INFO, other ranks only warnings and errors (each line says its rank)."""
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
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
    return logger
