"""Train a model from a TOML config.

    python scripts/train.py --config configs/debug_model.toml [--section.key=value ...] [--print-config] [--debug]
    torchrun --nproc_per_node 8 scripts/train.py --config CONFIG.toml   # any file in configs/
    python scripts/train.py --megatron-args "--num-layers 24 --hidden-size 1024 ..." [--section.key=value ...]

--megatron-args takes a Megatron-LM pretrain_gpt.py flag block as one argument (quoted, or @FILE to read it from a
file; backslash continuations, comments and the words before the first flag are fine): it is translated as by
scripts/from_megatron.py (docs/megatron.md), the flags it cannot map are listed, the TOML is written to
<run folder>/megatron_args.toml, and the run trains as if that TOML were given with --config; --section.key=value
overrides after it win, and a --config FILE given too is the base the flags are applied over.

Every key with its value (the defaults, or a config's): `--print-config`, alone or after `--config FILE`; what each
key means: the comments in titanlike/config/sections.py.

Memory: on a GPU the run first estimates each rank's memory for one step (titanlike/planner/memory.py: the real model
and plan on fake ranks, no device memory) and refuses a config that will not fit, printing the breakdown and the
cheapest fix; `--force` skips the check. `--dry-run [--gpus=N] [--gpu-mem=GiB]` only prints the estimate for N GPUs
(default: this launch's world size; no GPU needed; the default memory is this machine's GPU's, else 80 GiB): exit 0
when it fits, 1 when it does not.

Exit status: 0 done (or preempted with a checkpoint saved), 2 a configuration mistake, 1 a runtime failure (each one
line naming the key, file, step or rank and the fix; a traceback only with --debug), 128+N stopped by signal N with
nothing saved (SIGINT 130, SIGTERM 143).
"""
from __future__ import annotations

import logging
import os
import signal
import sys


def _stop_while_starting(signum, frame):  # until the trainer installs its own handlers (resilience/signals.py)
    print(f"error: interrupted by {signal.Signals(signum).name} while starting; nothing was saved", file=sys.stderr)
    os._exit(128 + signum)


for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):  # before the imports: importing torch takes seconds
    signal.signal(_sig, _stop_while_starting)

from titanlike.config import ConfigError, config_to_toml, load_config
from titanlike.config.load import SCRIPT_FLAGS, split_flags
from titanlike.config.megatron import MegatronError
from titanlike.config.megatron_args import load_with_megatron_args, take_block
from titanlike.observe.log import setup_logging
from titanlike.cli import tell_launcher
from titanlike.resilience.signals import Interrupted


def main(argv: list[str]) -> int:
    argv, flags = split_flags(argv, (*SCRIPT_FLAGS, "--dry-run", "--force"))
    argv, gpu_mem = _take_value(argv, "--gpu-mem")
    argv, gpus = _take_value(argv, "--gpus")  # --dry-run: the world size to estimate for
    if gpu_mem is not None and not gpu_mem.replace(".", "", 1).isdigit():
        print(f"error: --gpu-mem={gpu_mem}: GPU memory in GiB, a number such as 80", file=sys.stderr)
        return 2
    if flags & {"--help", "-h"}:
        print(__doc__.strip())
        return 0
    debug = "--debug" in flags
    logger = setup_logging()
    from titanlike.checkpoint import CheckpointError

    trainer, cfg, megatron = None, None, None
    try:
        try:
            argv, block = take_block(argv)
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
            if gpus is not None:
                if "--dry-run" not in flags or not gpus.isdigit() or int(gpus) < 1:
                    raise ValueError(f"--gpus={gpus}: a whole number >= 1, with --dry-run only (a run's world size "
                                     f"is torchrun's --nproc_per_node x --nnodes)")
                world_size = int(gpus)
            # printing a config needs no world: the degrees are checked against one only when one is given
            check_world = (None if "--print-config" in flags and gpus is None and "WORLD_SIZE" not in os.environ
                           else world_size)
            if block is None:
                cfg = load_config(argv, world_size=check_world)
            else:
                cfg, megatron = load_with_megatron_args(argv, block, check_world)
                _report_megatron(megatron, logger)
            if "--print-config" in flags:
                print(config_to_toml(cfg), end="")
                return 0
            if "--dry-run" in flags or "--force" not in flags:
                verdict = _memory_check(cfg, world_size, gpu_mem, dry_run="--dry-run" in flags, logger=logger)
                if verdict is not None:
                    return verdict
            from titanlike.train.trainer import Trainer

            trainer = Trainer(cfg)
            if megatron is not None and trainer.rank == 0:
                _write_megatron_toml(megatron, trainer.run_dir, logger)
        except (ConfigError, MegatronError, ValueError) as e:
            return _fail(e, 2, debug)
        except (OSError, CheckpointError) as e:  # a folder, file, lock or disk at set-up: the message names it
            return _fail(e, 1, debug)
        from titanlike.resilience.comm_watch import CommError
        from titanlike.resilience.nonfinite import NonFiniteError

        try:
            if cfg.checkpoint.create_seed_checkpoint:  # initialise and save step-0 (weights only); no training
                trainer.checkpointer.save_seed()
            else:
                trainer.train()
        except ConfigError as e:  # found while loading a checkpoint: the run's shape changed
            return _fail(e, 2, debug)
        except (CheckpointError, NonFiniteError, CommError, OSError) as e:  # names the file/step/rank and the fix
            return _fail(e, 1, debug)
    except (Interrupted, KeyboardInterrupt) as e:
        if debug:
            raise
        if trainer is not None:
            trainer.interrupted = True  # the peers may be gone: no barrier at close
        logging.getLogger("torch").setLevel(logging.ERROR)  # compile's teardown chatter after an interrupted step
        return _interrupted(e, trainer, cfg)
    finally:
        if trainer is not None:
            trainer.close()
    return _finished(trainer, cfg, logger)


def _take_value(argv: list[str], flag: str) -> tuple[list[str], str | None]:
    """Remove `flag=VALUE` from argv; returns (rest, VALUE or None)."""
    rest = [a for a in argv if not a.startswith(flag + "=")]
    values = [a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")]
    return rest, (values[-1] if values else None)


def _memory_check(cfg, world_size: int, gpu_mem: str | None, dry_run: bool, logger) -> int | None:
    """The estimate before anything is allocated (titanlike/planner/preflight.py). Returns an exit status to stop
    with (the dry run's verdict, or 1 for a run that will not fit), None to go on. On a CPU-only run without
    --dry-run there is no device memory to check."""
    import torch

    local = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = cfg.training.device != "cpu" and torch.cuda.is_available()
    if not (dry_run or on_gpu):
        return None
    if gpu_mem is not None:
        total, name = float(gpu_mem) * 2**30, "h100"
    elif on_gpu:
        total, name = torch.cuda.get_device_properties(local).total_memory, torch.cuda.get_device_name(local)
    else:
        total, name = 80.0 * 2**30, "h100"
    from titanlike.planner.gpus import UnknownGpu, gpu_kind
    from titanlike.planner.preflight import check_fits

    try:
        gpu_kind(name)
    except UnknownGpu:
        name = "h100"  # only ranks the fixes: the memory is the device's own
    try:
        fits, report, est = check_fits(cfg, world_size, total, name)
    except Exception as e:  # noqa: BLE001 - an estimator gap must never stop a run
        if dry_run:
            raise ValueError(f"--dry-run: the memory estimate failed ({type(e).__name__}: {e})") from e
        logger.warning(f"memory check skipped: the estimate failed ({type(e).__name__}: {str(e)[:200]})")
        return None
    if int(os.environ.get("RANK", "0")) == 0:
        print(report, file=sys.stdout if fits or dry_run else sys.stderr)
    if dry_run:
        return 0 if fits else 1
    if not fits:
        from titanlike.planner.preflight import UNCERTAIN_OVER, uncertain

        why = uncertain(cfg, world_size)
        if why and est.peak <= UNCERTAIN_OVER * total:
            logger.warning(f"the memory estimate says this config may not fit the GPU (above), but with {why} it has "
                           f"been up to {UNCERTAIN_OVER - 1:.0%} high (docs/planning.md): starting anyway")
            return None
        print("error: the estimate says this config does not fit the GPU (above); apply the fix, or --force to "
              "run it anyway", file=sys.stderr)
        return 1
    return None


def _report_megatron(megatron, logger) -> None:
    """Every flag the translation could not map, with why (never dropped silently); once per job."""
    if int(os.environ.get("RANK", "0")) == 0:
        for line in megatron.translation.said:  # which model the flags built, and why
            logger.info(f"--megatron-args: model: {line}")
        for flag, why in megatron.translation.unmapped:
            logger.warning(f"--megatron-args: unmapped: {flag}: {why}")


def _write_megatron_toml(megatron, run_dir: str, logger) -> None:
    path = os.path.join(run_dir, "megatron_args.toml")
    flags = "\n".join(f"# {line}" for line in megatron.block.strip().splitlines())
    with open(path + ".tmp", "w") as f:  # the TOML that was run, then the flag block it came from
        f.write(f"{megatron.toml}\n# The flag block given to --megatron-args:\n{flags}\n")
    os.replace(path + ".tmp", path)
    logger.info(f"--megatron-args: the equivalent TOML is {path} (train it again: --config that file and the same "
                f"overrides)")


def _fail(e: BaseException, code: int, debug: bool) -> int:
    if isinstance(e, BrokenPipeError):  # stdout's reader went away (`--print-config | head`): no error to report
        raise e
    if debug:  # the traceback, and still the status of the error's kind (2: fix the config)
        from titanlike.cli import debug_traceback

        debug_traceback(e)
    else:
        print(f"error: {_one_line(e)}", file=sys.stderr)
    tell_launcher(f"error: {_one_line(e)}")
    return code


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None and e.strerror:  # "[Errno 13] ..." into plain words
        return f"{e.strerror}: {e.filename} (check that the path exists and is writable, and the disk has room)"
    return str(e)


def _interrupted(e: BaseException, trainer, cfg) -> int:
    name = getattr(e, "signame", "SIGINT")
    where = getattr(e, "phase", "the run")
    step = f" at step {trainer.step}" if trainer is not None and trainer.step else ""
    if cfg is None:
        tail = "nothing was saved"
    elif not cfg.checkpoint.enable:
        tail = "checkpointing is off (checkpoint.enable=false), nothing was saved"
    elif _complete_steps(trainer, cfg):
        tail = "nothing was saved since the newest complete checkpoint: rerun the same command to resume from it"
    else:  # a new run stopped before its first save: there is nothing to resume
        tail = ("nothing was saved: this run has no checkpoint yet, so rerunning the same command starts it over"
                + (" (from checkpoint.initial_load_path)" if cfg.checkpoint.initial_load_path else ""))
    print(f"error: interrupted by {name} during {where}{step}; {tail}", file=sys.stderr)
    tell_launcher(f"error: interrupted by {name} during {where}{step}; {tail}")
    return 128 + int(getattr(signal, name, signal.SIGINT))


def _complete_steps(trainer, cfg) -> list[int]:
    """The run's own committed checkpoint steps (the folder the trainer uses, also before it exists)."""
    from titanlike.checkpoint import complete_steps
    from titanlike.resilience.ft import ft_run_dir

    if trainer is not None and getattr(trainer, "checkpointer", None) is not None:
        folder = trainer.checkpointer.folder
    else:
        run = ft_run_dir(cfg.fault_tolerance, os.path.join(cfg.job.dump_folder, cfg.job.run_name or "run"))
        folder = os.path.join(run, cfg.checkpoint.folder)
    try:
        return complete_steps(folder)
    except OSError:
        return []


def _finished(trainer, cfg, logger) -> int:
    if trainer.preempted:  # a clean stop at a step boundary
        name = trainer.signals.received or "a signal"
        if not cfg.checkpoint.enable:  # nothing to resume from: not a clean exit for the scheduler
            line = (f"error: stopped by {name} at step {trainer.step}; checkpointing is off (checkpoint.enable=false), "
                    f"so nothing was saved")
            print(line, file=sys.stderr)
            tell_launcher(line)
            return 128 + int(getattr(signal, name, signal.SIGTERM)) if name.startswith("SIG") else 143
        logger.info(f"preempted at step {trainer.step}: checkpoint saved ({name}); rerun the same command to resume")
        return 0
    logger.info("done")
    return 0


if __name__ == "__main__":
    from titanlike.cli import run_main

    code = run_main(main)  # a closed stdout (`--help | head`) ends it quietly
    # Everything is closed and flushed by now (checkpoints committed, TensorBoard closed, process group destroyed).
    # Skip the interpreter's teardown: with gloo on torch 2.13 a background thread occasionally aborts it
    # ("terminate called without an active exception"), which would turn a finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
