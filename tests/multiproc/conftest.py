"""tests/multiproc: multi-process parity (torchrun + gloo) and single-process parallelize/ checks.

The repo root must be importable (models, parallelize, titanlike, tests.launch): it is when pytest runs
as `python -m pytest` from the root; this makes plain `pytest` work too.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
