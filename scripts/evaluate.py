"""Evaluate a checkpoint: lm-evaluation-harness tasks, or perplexity on a dataset titanlike reads.

    python scripts/evaluate.py --tasks hellaswag,arc_easy --checkpoint outputs/my_run [--include-path DIR]
        [--limit N] [--output results.json] [--device cuda] [--dtype bfloat16] [--batch-size 16]
        [--num-fewshot K] [--step N] [--max-length L]
    python scripts/evaluate.py --perplexity --checkpoint outputs/my_run [--config FILE]
        --data.dataset=text --data.paths=val.jsonl [--validation.steps=100] [--training.seq_len=2048]
        [--training.local_batch_size=8] [--device cuda] [--dtype bfloat16]

--checkpoint: a run folder, checkpoint folder, step folder, export or Hugging Face folder (titanlike.infer.load).
Tasks: lm_eval's names (`lm-eval ls tasks`), or local YAML tasks in --include-path. `lm_eval --model titanlike` itself
cannot see titanlike's adapter (lm_eval 0.4 has no plugin discovery), so this script imports it and calls
lm_eval.simple_evaluate. Perplexity reads what the training loop's validation reads: --validation.split of
--data.* (or --validation.dataset/paths), --validation.steps batches of --training.local_batch_size x seq_len; it
prints loss, perplexity and tokens (and writes them as JSON with --output).

Exit status: 0 done, 2 a mistake in the arguments (one line), 1 a runtime failure (--debug for a traceback).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as every titanlike script
        raise ValueError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(add_help=False)
    p.add_argument("--checkpoint", default="")
    p.add_argument("--tasks", default="")
    p.add_argument("--perplexity", action="store_true")
    p.add_argument("--include-path", "--include_path", dest="include_path", default="")
    p.add_argument("--limit", type=float, default=None)
    p.add_argument("--output", default="")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--batch-size", "--batch_size", dest="batch_size", type=int, default=8)
    p.add_argument("--num-fewshot", "--num_fewshot", dest="num_fewshot", type=int, default=None)
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--max-length", dest="max_length", type=int, default=None)
    p.add_argument("--debug", action="store_true")
    p.add_argument("--help", "-h", action="store_true")
    return p


def _tasks(a, rest: list[str]) -> dict:
    from titanlike.config.validate_eval import task_problems
    from titanlike.eval.harness import TitanlikeLM
    from titanlike.eval.tasks import flat_metrics, run_tasks

    if rest:
        raise ValueError(f"unknown arguments {' '.join(rest)} (--section.key options are for --perplexity)")
    tasks = [t for t in a.tasks.split(",") if t]
    problems = task_problems(tasks, a.include_path, tasks_key="--tasks", include_key="--include-path")
    if problems:
        raise ValueError(problems[0])
    source, step = _resolve(a)  # the step folder, so that what is reported is what is loaded
    lm = TitanlikeLM(checkpoint=source, device=a.device, dtype=a.dtype, batch_size=a.batch_size,
                     max_length=a.max_length)
    _report(source, step)
    limit = int(a.limit) if a.limit is not None and a.limit >= 1 else a.limit
    results = run_tasks(lm, tasks, a.include_path, limit=limit, num_fewshot=a.num_fewshot, bootstrap_iters=1000,
                        device=lm.device)
    from lm_eval.utils import make_table

    print(make_table(results))
    return {"results": results.get("results", {}), "metrics": flat_metrics(results), "config": {
        "checkpoint": a.checkpoint, "step": step, "source": source, "tasks": tasks, "limit": a.limit,
        "num_fewshot": a.num_fewshot}}


def _resolve(a) -> tuple[str, int | None]:
    """(the step folder, its step) that --checkpoint and --step name, or (the HF folder, None)."""
    from titanlike.checkpoint.resolve import is_step_folder, resolve_step

    if os.path.isfile(os.path.join(a.checkpoint, "config.json")) and not is_step_folder(a.checkpoint):
        if a.step is not None:
            raise ValueError(f"--checkpoint {a.checkpoint} is a Hugging Face folder: it has no steps, drop --step")
        return a.checkpoint, None
    info = resolve_step(a.checkpoint, a.step)
    return info.path, info.step


def _report(source: str, step: int | None) -> None:
    what = f"the Hugging Face model in {source}" if step is None else f"step {step} from {source}"
    print(f"loaded {what}", file=sys.stderr)  # stderr: stdout holds the results


def _perplexity(a, rest: list[str]) -> dict:
    import torch

    from titanlike.config import load_config
    from titanlike.data import build_validation_dataloader
    from titanlike.data.tokenizers import build_tokenizer
    from titanlike.eval.perplexity import perplexity
    from titanlike.infer.load import load_for_inference

    cfg = load_config(rest)  # --config FILE and --data.*/--validation.*/--training.* overrides, validated
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    loaded = load_for_inference(a.checkpoint, device=device, dtype=getattr(torch, a.dtype), step=a.step)
    tokenizer = loaded.tokenizer if loaded.tokenizer is not None else build_tokenizer(cfg.data)
    t = cfg.training
    if t.seq_len > loaded.max_seq_len:
        raise ValueError(f"training.seq_len={t.seq_len} is longer than the model's {loaded.max_seq_len} positions; "
                         f"set --training.seq_len={loaded.max_seq_len} or less")
    loader = build_validation_dataloader(cfg.data, cfg.validation, tokenizer, dp_rank=0, dp_degree=1,
                                         local_batch_size=t.local_batch_size, seq_len=t.seq_len, seed=t.seed,
                                         vocab_size=loaded.args.vocab_size, steps=cfg.validation.steps)
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.startswith("cuda") and a.dtype == "float32" \
        else None
    out = perplexity(loaded.model, loader, cfg.validation.steps, device=device, context=amp)
    _report(loaded.source, loaded.step)
    print(f"loss {out['loss']:.6f}  perplexity {out['perplexity']:.4f}  tokens {out['tokens']:,}")
    return {**out, "checkpoint": a.checkpoint, "step": loaded.step, "source": loaded.source}


def main(argv: list[str]) -> int:
    from titanlike.observe.log import setup_logging

    debug = "--debug" in argv
    try:
        a, rest = _parser().parse_known_args(argv)
        if a.help:
            print(__doc__.strip())
            return 0
        if bool(a.tasks) == a.perplexity:
            raise ValueError("give --tasks NAME[,NAME] (lm-evaluation-harness) or --perplexity, one of them")
        if not a.checkpoint:
            raise ValueError("--checkpoint PATH is required (a run, checkpoint, step, export or Hugging Face folder)")
        if not os.path.exists(a.checkpoint):
            raise ValueError(f"--checkpoint {a.checkpoint}: no such file or folder")
        if a.include_path and not os.path.isdir(a.include_path):
            raise ValueError(f"--include-path {a.include_path}: not a folder; give the folder holding your task YAMLs")
        setup_logging()
        from titanlike.checkpoint.layout import CheckpointError
        from titanlike.config import ConfigError

        try:
            result = _perplexity(a, rest) if a.perplexity else _tasks(a, rest)
        except (CheckpointError, ConfigError) as e:
            raise ValueError(str(e)) from e
    except (ValueError, ImportError) as e:
        if debug:  # the traceback, and still status 2
            from titanlike.cli import debug_traceback

            debug_traceback(e)
        else:
            print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout's reader went away (`| head`): nothing to report
        raise
    except Exception as e:  # noqa: BLE001 - a runtime failure: one line unless --debug
        if debug:
            raise
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if a.output:
        with open(a.output, "w") as f:
            json.dump(result, f, indent=2, default=str)
        logging.getLogger("titanlike").info(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    from titanlike.cli import run_main

    sys.exit(run_main(main))
