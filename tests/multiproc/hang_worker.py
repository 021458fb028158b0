"""torchrun worker for test_dist_hang: scripts/train.py, except that rank 1 sleeps HANG_SLEEP seconds at the start
of step 3, before any of that step's collectives: the stand-in for a rank stuck in I/O, a slow host or a deadlock.
With HANG_KILL=1 rank 1 kills itself (SIGKILL) there instead: a crashed or OOM-killed rank."""
import signal
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import titanlike.train.trainer as trainer_module  # noqa: E402

_step = trainer_module.Trainer.train_step


def stalled_step(self, batches):
    if self.rank == 1 and self.step == 3:
        if os.environ.get("HANG_KILL") == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(float(os.environ["HANG_SLEEP"]))
    return _step(self, batches)


trainer_module.Trainer.train_step = stalled_step

import train  # noqa: E402  (scripts/train.py: builds the patched Trainer)

code = train.main(sys.argv[1:])
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
