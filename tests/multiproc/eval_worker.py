"""[eval] in the training loop on N gloo processes (tests/multiproc/test_dist_eval.py launches it): one run with eval,
one without; rank 0 prints one JSON line with both runs' losses and the eval results.

    python -m torch.distributed.run --nproc_per_node 2 tests/multiproc/eval_worker.py DUMP_DIR INCLUDE_PATH
"""
import json
import os
import sys

import torch

from titanlike.config.load import config_from_dict
from titanlike.train.trainer import Trainer


def eval_config(dump: str, include_path: str, world: int, enable: bool):
    """The tiny run tests/multiproc/test_dist_eval.py also runs on one process: the same global batch of 4 on any world
    size."""
    return config_from_dict({
        "job": {"dump_folder": dump, "run_name": f"eval{int(enable)}_w{world}"},
        "model": {"flavor": "debugmodel", "n_layers": 2},
        "training": {"steps": 2, "seq_len": 32, "local_batch_size": 4 // world, "device": "cpu", "seed": 3},
        "data": {"dataset": "stdlib"},
        "lr_scheduler": {"warmup_steps": 1},
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
        "validation": {"steps": 2},
        "eval": {"enable": enable, "interval": 1, "tasks": ["titanlike_tiny_choice", "titanlike_tiny_rolling"],
                 "include_path": include_path, "batch_size": 2, "perplexity_sets": ["stdlib"]},
    })


def run(cfg) -> tuple[list[float], list[dict]]:
    """(losses, eval results per evaluation); the results get "shard_degree": the DP ranks sharing the requests."""
    trainer = Trainer(cfg)
    evals = []
    log_eval = trainer.metrics.log_eval
    trainer.metrics.log_eval = lambda step, res, *times: (evals.append(dict(res)), log_eval(step, res, *times))
    try:
        history = trainer.train()
    finally:  # as checkpoint_worker.py: the process group stays up for the next run (destroyed once, in main)
        trainer.close(keep_process_group=True)  # (its heartbeat thread would outlive the run inside pytest)
    state = trainer.in_loop_eval
    for e in evals:
        e["shard_degree"] = state.lm.shard[1] if state and state.lm.shard else 1
    return [h["loss"] for h in history], evals


def main(dump: str, include_path: str) -> None:
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    with_eval, evals = run(eval_config(dump, include_path, world, True))
    without, _ = run(eval_config(dump, include_path, world, False))
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps({"with": with_eval, "without": without, "evals": evals}), flush=True)
    from titanlike.distributed.init import destroy_distributed

    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    os._exit(0)  # as checkpoint_worker.py: skip the teardown that gloo's threads occasionally abort
