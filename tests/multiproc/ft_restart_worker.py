"""The restarted replica group of test_dist_torchft, minus the interpreter start-up: imports torch and the trainer
(seconds on 2 busy cores), prints "ready", waits until the file $FT_GO exists, then runs scripts/train.py's main.
Without this the survivor, training alone at full speed, may finish before a cold interpreter reaches its first
quorum. Nothing of replica group 1's state exists in this process before the go: it starts like any restart."""
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import titanlike.train.trainer  # noqa: E402,F401  (the slow imports: torch, torchao, ...)
import train  # noqa: E402

print("ready", flush=True)
while not os.path.exists(os.environ["FT_GO"]):
    time.sleep(0.02)
code = train.main(sys.argv[1:])
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
