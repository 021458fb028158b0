"""scripts/train.py, except that one place of the run blocks forever once reached: STALL_IN=data (the data wait of
step STALL_STEP) or STALL_IN=load (checkpoint load). The stand-in for a stuck filesystem or a dataset that never
yields, for the signal tests (tests/unit/test_signals.py)."""
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import titanlike.train.trainer as trainer_module  # noqa: E402

WHERE, AT = os.environ.get("STALL_IN", "data"), int(os.environ.get("STALL_STEP", "3"))


def _forever():
    print("stalling", flush=True)
    while True:
        time.sleep(3600)


_next = trainer_module.Trainer.next_batches


def next_batches(self, data_iter):
    if WHERE == "data" and self.step == AT:
        _forever()
    return _next(self, data_iter)


trainer_module.Trainer.next_batches = next_batches
if WHERE == "load":
    from titanlike.checkpoint import CheckpointManager

    CheckpointManager.load = lambda self, *a, **k: _forever()

import train  # noqa: E402  (scripts/train.py: builds the patched Trainer)

code = train.main(sys.argv[1:])
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
