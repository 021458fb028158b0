"""Train a model from a TOML config.

    python scripts/train.py --config configs/debug_model.toml [--section.key=value ...] [--print-config] [--debug]
    torchrun --nproc_per_node 8 scripts/train.py --config CONFIG.toml   # any file in configs/

Every key with its value (the defaults, or a config's): `--print-config`, alone or after `--config FILE`; what each
key means: the comments in titanlike/config/sections.py.

Configuration mistakes exit with status 2 and one line naming the key and the fix (a traceback only with --debug).
"""
from __future__ import annotations

import os
import sys


from titanlike.config import ConfigError, config_to_toml, load_config
from titanlike.config.load import split_flags
from titanlike.observe.log import setup_logging


def main(argv: list[str]) -> int:
    argv, flags = split_flags(argv)
    if flags & {"--help", "-h"}:
        print(__doc__.strip())
        return 0
    debug = "--debug" in flags
    logger = setup_logging()
    try:
        cfg = load_config(argv, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        if "--print-config" in flags:
            print(config_to_toml(cfg), end="")
            return 0
        from titanlike.train.trainer import Trainer

        trainer = Trainer(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    from titanlike.checkpoint import CheckpointError
    from titanlike.resilience.nonfinite import NonFiniteError
    from titanlike.resilience.comm_watch import CommError

    try:
        if cfg.checkpoint.create_seed_checkpoint:  # initialise and save step-0 (weights only); no training
            trainer.checkpointer.save_seed()
        else:
            trainer.train()
    except (CheckpointError, NonFiniteError, CommError) as e:  # says which file/step/rank and what to do
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        trainer.close()
    if trainer.preempted:  # a clean stop: the scheduler requeues the same command, which resumes
        logger.info(f"preempted at step {trainer.step}: "
                    f"{'checkpoint saved' if cfg.checkpoint.enable else 'checkpointing is off, nothing saved'}")
        return 0
    logger.info("done")
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # Everything is closed and flushed by now (checkpoints committed, TensorBoard closed, process group destroyed).
    # Skip the interpreter's teardown: with gloo on torch 2.13 a background thread occasionally aborts it
    # ("terminate called without an active exception"), which would turn a finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
