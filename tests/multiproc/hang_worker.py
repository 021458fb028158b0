"""torchrun worker for test_dist_hang: scripts/train.py, except that rank 1 sleeps HANG_SLEEP seconds at the start
of step 3, before any of that step's collectives: the stand-in for a rank stuck in I/O, a slow host or a deadlock.
With HANG_KILL=1 rank 1 kills itself (SIGKILL) there instead: a crashed or OOM-killed rank; with HANG_KILL_IN=save it
does so as it starts writing step 2's checkpoint (checkpoint.async_mode=disabled)."""
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


def stalled_step(self, batches, **kwargs):
    if self.rank == 1 and self.step == 3:
        if os.environ.get("HANG_KILL") == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(float(os.environ["HANG_SLEEP"]))
    return _step(self, batches, **kwargs)


trainer_module.Trainer.train_step = stalled_step

if os.environ.get("HANG_KILL_IN") == "save":  # rank 1 dies inside the write of step 2's checkpoint instead
    from titanlike.checkpoint.manager import CheckpointManager

    _write = CheckpointManager._write_sync

    def dying_write(self, sd, tmp, step):
        if self.rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return _write(self, sd, tmp, step)

    CheckpointManager._write_sync = dying_write

import train  # noqa: E402  (scripts/train.py: builds the patched Trainer)

code = train.main(sys.argv[1:])
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
