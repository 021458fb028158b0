"""torchrun worker for tests/multiproc/test_data_reshard.py (2 ranks, gloo).

argv: DATA_DIR CACHE_DIR STATE_FROM_1RANK OUT_DIR
  A  (2 -> 1): read 3 micro-batches at dp 2 x local 2, write the rows seen and the loader state.
  B  (1 -> 2): load the state a 1-rank run saved and read 4 micro-batches at dp 2 x local 2.
  C  the Trainer on the same indexed data under FSDP (dp_shard 2) with validation on the valid split.
"""
import os
import sys

import torch
import torch.distributed as dist

from titanlike.config import load_config
from titanlike.config.sections import Data
from titanlike.data import build_dataloader

data_dir, cache_dir, state_1rank, out_dir = sys.argv[1:5]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 2
cfg = Data(dataset="indexed", paths=[f"0.3 {data_dir}/a 0.7 {data_dir}/b"], split="90,10,0", cache_dir=cache_dir)


def loader():
    return build_dataloader(cfg, None, dp_rank=rank, dp_degree=2, local_batch_size=2, seq_len=16, seed=7,
                            vocab_size=256)


def rows(it, n):
    return [x.clone() for _ in range(n) for x in [next(it)[0]]]


# A: 2 ranks first, then (in pytest) 1 rank
dl = loader()
it = iter(dl)
seen_a = rows(it, 3)
state = dl.state_dict()
states = [None, None]
dist.all_gather_object(states, state["global_sampler"])
assert states[0] == states[1], states  # the data state is the same on every rank: any rank's copy reshards
torch.save({"rows": seen_a, "state": state}, os.path.join(out_dir, f"a_rank{rank}.pt"))

# B: a 1-rank state continues on 2 ranks
dl = loader()
dl.load_state_dict(torch.load(state_1rank, weights_only=False))
torch.save({"rows": rows(iter(dl), 4)}, os.path.join(out_dir, f"b_rank{rank}.pt"))

# C: training + validation under FSDP on the same data; validation loss equal on both ranks
from titanlike.train.trainer import Trainer  # noqa: E402

job = load_config([
    "--config", "configs/debug_model.toml", "--training.steps=2", "--lr_scheduler.warmup_steps=1",
    "--training.seq_len=16",
    "--training.local_batch_size=2", "--training.device=cpu", "--training.mixed_precision_param=float32",
    "--data.dataset=indexed", f"--data.paths=0.3 {data_dir}/a 0.7 {data_dir}/b", "--data.split=90,10,0",
    "--data.tokenizer_type=NullTokenizer", "--data.builtin_vocab_size=255", f"--data.cache_dir={cache_dir}",
    "--validation.enable=true", "--validation.interval=1", "--validation.steps=2",
    "--metrics.enable_tensorboard=false", "--metrics.log_freq=1", f"--job.dump_folder={out_dir}/run",
    "--parallelism.dp_shard=2",
], world_size=2)
trainer = Trainer(job)
trainer.train()
val = trainer.validate()
vals = [None, None]
dist.all_gather_object(vals, val)
assert vals[0] == vals[1] and 0 < val < 20, vals
if rank == 0:
    print(f"VALID_LOSS {val:.4f}")
trainer.close()
# Skip interpreter teardown: on 2 busy cores a gloo/loader thread destructor occasionally aborted the process
# *after* every check above had passed ("terminate called without an active exception").
sys.stdout.flush()
os._exit(0)
